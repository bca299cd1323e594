"""Launching the training ranks: with a world size above one, `eagle-jobs train` runs as torchrun's
ranks in child processes, each leaving the exit code of a named failure for the launcher.

Imports neither speculators nor the data code: the launcher starts the ranks without them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_jobs.committed import checkpoint_manifest
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.layout import train_dir
from eagle_jobs.progress import console
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import TrainRecord
from eagle_jobs.settings import settings
from eagle_jobs.store import Stage, Store

# torchrun's own grace for its ranks after it is signalled (its default is 30 s): the
# SIGTERM checkpoint save and its upload must fit (plan.make_plan's train_checkpoint: ~150 s
# for a Kimi-K2.5 draft at a 100 MB/s store), and all of it inside the train pod's
# terminationGracePeriodSeconds (300 s in k8s/base/pipeline.yaml; tests/test_k8s_preemption.py).
RANK_SHUTDOWN_TIMEOUT_S = 270


@dataclass(frozen=True)
class Ranks:
    """How many training ranks torchrun starts: `per_node` on each of `nodes` nodes."""

    per_node: int
    nodes: int = 1


def torchrun_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown_timeout (torch 2.13 does; 2.11 does not)."""
    from torch.distributed.run import get_args_parser

    return any("--shutdown_timeout" in a.option_strings for a in get_args_parser()._actions)


def launch_ranks(recipe: Recipe, store: Store, run_id: str, max_steps: int | None, work: Path,
                 variant: str | None = None) -> TrainRecord | None:
    """With a world size above one, train as torchrun's ranks in child processes; None otherwise.

    The ranks get exactly this recipe (as JSON in the work dir) and `eagle-jobs
    train`, whatever command started us: re-executing our own command line would
    make `eagle-jobs run` capture and extract again in every rank. SIGTERM and
    SIGINT are forwarded to torchrun. Each rank leaves the exit code of a named
    failure in a file, so we exit with it (torchrun itself says 1 for any failure).
    """
    t = recipe.train
    nnodes = settings().nnodes or t.nnodes  # full-multinode overlay sets it
    if t.nproc_per_node * nnodes <= 1 or "LOCAL_RANK" in os.environ:
        return None
    if torch.cuda.is_available() and torch.cuda.device_count() < t.nproc_per_node:
        raise BadInput(f"train.nproc_per_node is {t.nproc_per_node} but this node has {torch.cuda.device_count()} "
                       f"GPU(s): lower it in the recipe or request {t.nproc_per_node} GPUs")
    return run_ranks(recipe, store, run_id, max_steps, work, Ranks(t.nproc_per_node, nnodes), variant)


def run_ranks(recipe: Recipe, store: Store, run_id: str, max_steps: int | None, work: Path, ranks: Ranks,
              variant: str | None = None) -> TrainRecord:
    """torchrun with `eagle-jobs train` as each rank (see launch_ranks); the committed record."""
    work.mkdir(parents=True, exist_ok=True)
    recipe_file = work / "recipe.json"
    recipe_file.write_text(json.dumps(recipe.model_dump(mode="json")))
    exits = work / "rank-exits"
    shutil.rmtree(exits, ignore_errors=True)
    exits.mkdir()
    from eagle_jobs.rendezvous import torchrun_rendezvous_args

    args = [*torchrun_rendezvous_args(ranks.nodes, os.environ), "--nproc_per_node", str(ranks.per_node)]
    if torchrun_has_shutdown_timeout():
        args += ["--shutdown_timeout", str(RANK_SHUTDOWN_TIMEOUT_S)]
    else:
        console.print(f"[yellow]torch {torch.__version__}'s torchrun has no --shutdown_timeout: after SIGTERM the "
                      "ranks get its fixed 30 s, which a large draft's checkpoint save may not fit in; the train "
                      "image's torch (images/train/Dockerfile) has it[/]")
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "eagle_jobs.cli", "train",
           "--recipe", str(recipe_file), "--store", store.uri, "--run-id", run_id]
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    if variant is not None:
        cmd += ["--variant", variant]
    console.print(f"  {ranks.per_node * ranks.nodes} rank(s) on {ranks.nodes} node(s): {' '.join(cmd[1:5])} ...")
    root = work.parent if variant is None else work.parents[len(Path(train_dir(variant)).parts)]  # <root>/<run>/...
    env = {**os.environ, "EAGLE_JOBS_WORK_DIR": str(root), "EAGLE_JOBS_RANK_EXITS": str(exits)}
    signalled: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum, _frame):
        signalled.append(signum)
        if proc is not None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}  # before the start: no gap
    try:
        if not signalled:
            proc = subprocess.Popen(cmd, env=env)
        rc = proc.wait() if proc is not None else 128 + signal.SIGTERM
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    stage = Stage(store, run_id, train_dir(variant))
    final = checkpoint_manifest(stage, "final") if rc == 0 else None
    if final is not None:  # the record run_train returns, as rank 0 committed it
        files = final["files"]
        record: TrainRecord = json.loads(stage.read("final/train_config.json", files["final/train_config.json"]))
        record["metrics"] = json.loads(stage.read("final/metrics.json", files["final/metrics.json"]))
        return record
    codes = [int(p.read_text()) for p in sorted(exits.iterdir(), key=lambda p: int(p.name))]
    if signalled:
        raise EagleJobsError("train: interrupted by a signal; the ranks committed their checkpoint, rerun to resume",
                             ExitCode.INTERRUPTED)
    code = ExitCode(codes[0]) if codes else ExitCode.ERROR
    raise EagleJobsError(f"train: torchrun exited {rc}; first failing rank's exit code {int(code)} "
                         f"(its error is in the log above)", code)


def record_rank_exit(code: int) -> None:
    """Under `launch_ranks`: leave this rank's exit code for the launcher (see there)."""
    d = settings().rank_exits
    if d is not None and "RANK" in os.environ:  # torchrun's
        (d / os.environ["RANK"]).write_text(str(int(code)))

