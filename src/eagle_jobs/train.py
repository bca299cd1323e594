"""Stage 3, train: the EAGLE-3 draft, with speculators 0.9.0's model, Trainer and data code.

Reads top to bottom: check the extraction against the recipe, resolve the draft
shape, build the vocab mapping from loss-masked token counts, stage the shards,
build the model and loaders, train (checkpoints committed to the store every
epoch, every train.checkpoint_every_minutes and on SIGTERM, resuming from the
newest at its exact step), export the final checkpoint.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PretrainedConfig

from eagle_jobs.committed import extraction_info, iter_rows, row_index
from eagle_jobs.draft import (
    DraftShape,
    build_draft_model,
    loss_implementation,
    optimizer_settings,
    resolve_shape,
    stored_layer_ids,
    trainer_call_kwargs,
)
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.layout import StageName, train_dir
from eagle_jobs.progress import console
from eagle_jobs.recipe import Recipe
from eagle_jobs.store import Stage, Store
from eagle_jobs.verifier import load_config, text_config

STAGE = StageName.TRAIN.dir


# -- data ---------------------------------------------------------------------------
class ShardStager:
    """Copies committed shards to bounded local disk ahead of the trainer (one per node).

    Readers use the local copy once it is there and range-read the store until
    then, so training never waits for a whole shard and local disk stays under
    `train.local_stage_bytes`. Stored mode stages the extraction's shards in order; streaming
    stages each shard a later epoch reads again as it commits (`stream.committed_in_order`).
    """

    def __init__(self, store: Store, run_id: str, manifests: Iterable[dict], root: Path, budget: int):
        self.store, self.root, self.budget = store, root, budget
        self.stage = Stage(store, run_id, StageName.EXTRACT.dir)
        self.manifests = manifests
        root.mkdir(parents=True, exist_ok=True)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from eagle_jobs.train_data import staged_name

        used = 0
        for m in self.manifests:
            (fname, info), = m["files"].items()
            if used + info["size"] > self.budget:
                return
            dest = self.root / staged_name(fname, info)
            if not dest.exists():
                data = self.stage.read(fname, info)  # sha256-checked against the manifest
                tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, dest)
            used += info["size"]

    def start(self) -> "ShardStager":
        self.thread.start()
        return self


def token_frequencies(manifests: list[dict], store: Store, run_id: str, cache: Path | None = None) -> Counter:
    """Counts of loss-masked target tokens in the training split (speculators' token_freq): of the
    extracted training samples, or (streaming, no manifests yet) of the training split's rows.

    Reading every capture row takes minutes at the Kimi recipe's scale (1.5 B tokens of JSON): with `cache`
    (a file in the node's work dir, named for what it counts), the first rank of a node counts and the
    others, holding its lock, read the counts."""
    if cache is None:
        return _count_tokens(manifests, store, run_id)
    import fcntl

    from eagle_jobs.layout import content_hash

    key = content_hash([run_id, (Stage(store, run_id, StageName.CAPTURE.dir).completion() or {}).get("completed_at"),
                        sorted((m["shard"], sorted(f["sha256"] for f in m["files"].values())) for m in manifests)], 16)
    path = cache.with_name(f"{cache.name}-{key}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if path.exists():
            return Counter({int(t): n for t, n in json.loads(path.read_text()).items()})
        freq = _count_tokens(manifests, store, run_id)
        tmp = path.with_name(f"{path.name}.part-{os.getpid()}")
        tmp.write_text(json.dumps(freq))
        os.replace(tmp, path)
        return freq


def _count_tokens(manifests: list[dict], store: Store, run_id: str) -> Counter:
    extracted = {e["row_id"] for m in manifests for e in m["samples"] if e["split"] == "train"}
    freq: Counter = Counter()
    for r in iter_rows(store, run_id):  # a few capture shards at a time: the counts, never the rows, stay
        if r["row_id"] in extracted if manifests else r["split"] == "train":
            freq.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return freq


# -- checkpoints in the store -------------------------------------------------------
def committed_checkpoints(stage: Stage) -> list[dict]:
    return [m for m in stage.manifests() if m["shard"].startswith("checkpoint-")]


def checkpoint_name(epoch: int, local_step: int) -> str:
    """checkpoint-<epoch> at an epoch's end (local_step 0, speculators' convention), and
    checkpoint-<epoch>-step-<step> mid-epoch: a name is committed once, never rewritten."""
    return f"checkpoint-{epoch:04d}" + (f"-step-{local_step:07d}" if local_step else "")


def checkpoint_order(m: dict) -> tuple[int, float]:
    """Older first: an epoch's end comes after every step of that epoch."""
    return (m["epoch"], m["local_step"] or math.inf)


def restore_latest(stage: Stage, local: Path, recipe_digest: str) -> dict | None:
    """Put the newest committed checkpoint, epoch or step, where speculators' Trainer resumes from;
    its manifest, or None."""
    ckpts = committed_checkpoints(stage)
    if not ckpts:
        return None
    m = max(ckpts, key=checkpoint_order)
    if m.get("recipe_digest") != recipe_digest:
        raise BadInput(f"run '{stage.run_id}' has checkpoints from another recipe (digest {m.get('recipe_digest')}, "
                       f"this one {recipe_digest}): use a new --run-id, or delete {stage.store.url(stage.prefix)}")
    restore_checkpoint(stage, local, m)
    return m


def epoch_checkpoints(stage: Stage) -> dict[int, dict]:
    """The committed end-of-epoch checkpoints (the export's candidates): epoch -> manifest."""
    return {m["epoch"]: m for m in committed_checkpoints(stage) if not m["local_step"]}


def restore_epoch(stage: Stage, local: Path, epoch: int) -> None:
    """The end-of-epoch checkpoint of `epoch` back on local disk (the export's source)."""
    restore_checkpoint(stage, local, epoch_checkpoints(stage)[epoch])


# What final/ keeps of a checkpoint: the weights and config vLLM serves, and speculators' validation.
SERVED_FILES = ("model.safetensors", "config.json", "val_metrics.json")


def restore_served(stage: Stage, m: dict, dest: Path) -> Path:
    """Only what vLLM serves of the checkpoint `m`, in dest: a draft directory, without the optimizer
    state (the draft's twice over) that a resume needs and a server does not."""
    dest.mkdir(parents=True, exist_ok=True)
    for f, info in m["files"].items():
        name = f.split("/", 1)[1]
        if name in SERVED_FILES:
            (dest / name).write_bytes(stage.read(f, info))
    return dest


def restore_checkpoint(stage: Stage, local: Path, m: dict) -> None:
    from eagle_jobs.speculators_compat import import_checkpoint_dir

    objects = {f.split("/", 1)[1]: stage.read(f, info) for f, info in m["files"].items()}
    import_checkpoint_dir(objects, local / str(m["epoch"]))


def select_epoch(records: list[dict], k: int, last: int) -> dict:
    """The epoch whose checkpoint becomes final/: the best held-out τ estimate, not the lowest loss.

    EAGLE-3 drafts peak after a few epochs and then lose τ while their loss keeps falling. Per epoch,
    speculators' validation gives full_acc_i: the share of held-out positions whose first i+1 draft
    tokens are all right, teacher forced; 1 + Σ_{i<k} full_acc_i estimates τ at k.
    """
    est: dict[int, float] = {}
    for r in records:
        if "val" in r and "epoch" in r:
            accs = [r["val"].get(f"full_acc_{i}_epoch") for i in range(k)]
            if all(a is not None for a in accs):
                est[int(r["epoch"])] = 1 + sum(accs)
    if not est:
        return {"epoch": last, "by": "the last epoch: no held-out samples to measure on", "per_epoch": {}}
    best = max(sorted(est), key=lambda e: est[e])  # the earliest among equals
    return {"epoch": best, "by": f"the best held-out teacher-forced tau estimate, 1 + sum of full_acc_i for i < {k} "
            "(not the lowest loss)", "tau_estimate": est[best], "last_epoch": last,
            "per_epoch": {str(e): est[e] for e in sorted(est)}}


def estimate_depth(recipe: Recipe) -> int:
    """The k of the tau estimate: the draft tokens evaluate serves, as far as training validated them."""
    return min(recipe.evaluate.k, recipe.train.ttt_steps)


def commit_checkpoint(stage: Stage, local: Path, epoch: int, local_step: int, extra: dict) -> dict:
    """speculators' local `<epoch>/` directory as one shard of the store; its manifest."""
    from eagle_jobs.speculators_compat import export_checkpoint_dir

    name = checkpoint_name(epoch, local_step)
    objects = {f"{name}/{k}": v for k, v in export_checkpoint_dir(local / str(epoch)).items()}
    m = stage.commit_shard(name, objects, {"epoch": epoch, "local_step": local_step, **extra})
    console.print(f"  committed {name} (step {local_step or 'end'}) to {stage.store.url(stage.prefix)}")
    return m


def prune_step_checkpoints(stage: Stage, newest: dict) -> None:
    """Step checkpoints older than `newest` (just committed, step or epoch) are superseded: each is
    uncommitted (its manifest first, so no reader finds a manifest without its objects), then its
    objects go. Epoch checkpoints stay: the export chooses among them."""
    for m in committed_checkpoints(stage):
        if m["local_step"] and checkpoint_order(m) < checkpoint_order(newest):
            stage.store.delete(stage.key(f"manifests/{m['shard']}.json"))
            stage.store.delete(stage.key(f"data/{m['shard']}"))


def prune_local_checkpoints(ckpt_dir: Path, committed: int) -> None:
    """Once epoch `committed` is in the store, older local epochs are only disk: a Kimi-K2.5 draft's is
    about 8 GiB, and ten of them would fill the pod's /work. The newest stays, for the final export."""
    for p in ckpt_dir.iterdir():
        if p.name.isdigit() and not p.is_symlink() and int(p.name) < committed:
            shutil.rmtree(p)


# -- the entry ------------------------------------------------------------------------
# torchrun's own grace for its ranks after it is signalled (its default is 30 s): the
# SIGTERM checkpoint save and its upload must fit (plan.make_plan's train_checkpoint: ~150 s
# for a Kimi-K2.5 draft at a 100 MB/s store), and all of it inside the train pod's
# terminationGracePeriodSeconds (300 s in k8s/base/pipeline.yaml; tests/test_k8s_preemption.py).
RANK_SHUTDOWN_TIMEOUT_S = 270


def torchrun_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown_timeout (torch 2.13 does; 2.11 does not)."""
    from torch.distributed.run import get_args_parser

    return any("--shutdown_timeout" in a.option_strings for a in get_args_parser()._actions)


def launch_ranks(recipe: Recipe, store: Store, run_id: str, max_steps: int | None, work: Path,
                 variant: str | None = None) -> dict | None:
    """With a world size above one, train as torchrun's ranks in child processes; None otherwise.

    The ranks get exactly this recipe (as JSON in the work dir) and `eagle-jobs
    train`, whatever command started us: re-executing our own command line would
    make `eagle-jobs run` capture and extract again in every rank. SIGTERM and
    SIGINT are forwarded to torchrun. Each rank leaves the exit code of a named
    failure in a file, so we exit with it (torchrun itself says 1 for any failure).
    """
    t = recipe.train
    nnodes = int(os.environ.get("EAGLE_JOBS_NNODES") or t.nnodes)  # full-multinode overlay sets it
    if t.nproc_per_node * nnodes <= 1 or "LOCAL_RANK" in os.environ:
        return None
    if torch.cuda.is_available() and torch.cuda.device_count() < t.nproc_per_node:
        raise BadInput(f"train.nproc_per_node is {t.nproc_per_node} but this node has {torch.cuda.device_count()} "
                       f"GPU(s): lower it in the recipe or request {t.nproc_per_node} GPUs")
    return run_ranks(recipe, store, run_id, max_steps, work, t.nproc_per_node, nnodes, variant)


def run_ranks(recipe: Recipe, store: Store, run_id: str, max_steps: int | None, work: Path,
              nproc_per_node: int, nnodes: int = 1, variant: str | None = None) -> dict:
    """torchrun with `eagle-jobs train` as each rank (see launch_ranks); the committed record."""
    work.mkdir(parents=True, exist_ok=True)
    recipe_file = work / "recipe.json"
    recipe_file.write_text(json.dumps(recipe.model_dump(mode="json")))
    exits = work / "rank-exits"
    shutil.rmtree(exits, ignore_errors=True)
    exits.mkdir()
    from eagle_jobs.rendezvous import torchrun_rendezvous_args

    args = [*torchrun_rendezvous_args(nnodes, os.environ), "--nproc_per_node", str(nproc_per_node)]
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
    console.print(f"  {nproc_per_node * nnodes} rank(s) on {nnodes} node(s): {' '.join(cmd[1:5])} ...")
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
    final = stage.manifest("final") if rc == 0 else None
    if final is not None:  # the record run_train returns, as rank 0 committed it
        read = {k: json.loads(stage.read(f"final/{k}.json", final["files"][f"final/{k}.json"]))
                for k in ("train_config", "metrics")}
        return {**read["train_config"], "metrics": read["metrics"]}
    codes = [int(p.read_text()) for p in sorted(exits.iterdir(), key=lambda p: int(p.name))]
    if signalled:
        raise EagleJobsError("train: interrupted by a signal; the ranks committed their checkpoint, rerun to resume",
                             ExitCode.INTERRUPTED)
    code = ExitCode(codes[0]) if codes else ExitCode.ERROR
    raise EagleJobsError(f"train: torchrun exited {rc}; first failing rank's exit code {int(code)} "
                         f"(its error is in the log above)", code)


def record_rank_exit(code: int) -> None:
    """Under `launch_ranks`: leave this rank's exit code for the launcher (see there)."""
    d = os.environ.get("EAGLE_JOBS_RANK_EXITS")
    if d and "RANK" in os.environ:
        (Path(d) / os.environ["RANK"]).write_text(str(int(code)))


def run_train(recipe: Recipe, store: Store, run_id: str, max_steps: int | None = None,
              work_dir: Path | None = None, variant: str | None = None) -> dict:
    """Train the run's draft on its committed extraction (or, with `variant`, one arm of `compare`)."""
    # 1. the extraction must be the one this draft expects
    info, tcfg, shape = check_extraction(recipe, store, run_id)
    work = Path(work_dir or os.environ.get("EAGLE_JOBS_WORK_DIR") or Path.home() / ".cache/eagle-jobs/work") / run_id
    if variant is not None:
        work = work / train_dir(variant)
    started = time.time()
    launched = launch_ranks(recipe, store, run_id, max_steps, work, variant)  # world size > 1: torchrun's ranks
    if launched is not None:
        return launched
    # speculators (about 8 s of imports) only here, in the process that trains: torchrun's launcher above
    # starts the ranks without it
    from speculators.train.distributed import maybe_destroy_distributed

    # 2. this rank: speculators adapted, the device's attention, loss and state dtype
    rank = RankSetup.create(recipe)
    # 3. vocab mapping from loss-masked token frequencies
    d2t, t2d, coverage = vocab_mapping(info, store, run_id, shape, work)
    # 4. data: shards staged ahead to bounded local disk; one loader per split
    data = TrainData.create(recipe, store, run_id, info, shape, work, rank.hs_dtype)
    # 5. model: speculators' Eagle3DraftModel with draft.architecture's layer and draft.norms
    model = build_draft_model(shape, recipe, tcfg, rank.attention, t2d, d2t)
    assert next(model.fc.parameters()).dtype == torch.float32  # fp32 master weights
    params = {"total": sum(p.numel() for p in model.parameters()),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    console.print(f"  draft parameters: {params['total']:,} total, {params['trainable']:,} trainable; "
                  f"attention {rank.attention}, loss {rank.loss}")
    # 6. resume from the newest committed checkpoint
    stage = Stage(store, run_id, train_dir(variant))
    ckpt_dir = work / "checkpoints"
    resumed = resume_checkpoint(recipe, stage, ckpt_dir)
    record = train_record(recipe, run_id, info, shape, rank, data, params, coverage, max_steps)
    # 7. train, committing checkpoints; export the epoch with the best held-out tau estimate
    fit_and_export(recipe, model, data, rank, stage, work, ckpt_dir, resumed, record, max_steps, started)
    maybe_destroy_distributed()
    return record


def check_extraction(recipe: Recipe, store: Store, run_id: str) -> tuple[dict, PretrainedConfig, DraftShape]:
    """The committed extraction's info, the verifier's text config and the draft shape, checked against each other."""
    tcfg = text_config(load_config(recipe.verifier))
    if recipe.train.source == "stream":  # extraction is still going on: its layout is the recipe's
        from eagle_jobs.hsformat import resolve_storage

        layer_ids, hidden = stored_layer_ids(recipe.aux_layer_ids, int(tcfg.num_hidden_layers)), int(tcfg.hidden_size)
        rows = row_index(store, run_id)  # what extraction plans the stream from; read once, kept in info
        storage = resolve_storage(recipe.extract.storage_dtype, sum(r.num_tokens for r in rows), len(layer_ids),
                                  hidden, recipe.extract.fp8_above_bytes)
        info: dict = {"manifests": [], "storage": storage, "hidden_size": hidden, "layer_ids": layer_ids,
                      "rows": rows}
    else:
        info = extraction_info(store, run_id)
    shape = resolve_shape(recipe, tcfg)
    aux = info["layer_ids"][:-1]
    if aux != recipe.aux_layer_ids:
        raise BadInput(f"extraction of run '{run_id}' stored aux layers {aux}, the recipe's draft wants "
                       f"{recipe.aux_layer_ids}: rerun extract with this recipe or fix aux_layer_ids")
    if info["hidden_size"] != shape.hidden_size:
        raise BadInput(f"extraction hidden size {info['hidden_size']} != draft hidden size {shape.hidden_size}")
    console.print(f"[bold]train[/] draft shape: {shape.describe()}")
    return info, tcfg, shape


@dataclass(frozen=True)
class RankSetup:
    """What this process trains with, decided once: accelerator, attention, loss and hidden-state dtype."""

    gpu: bool
    attention: str
    loss: str
    hs_dtype: torch.dtype

    @classmethod
    def create(cls, recipe: Recipe) -> RankSetup:
        from eagle_jobs import speculators_compat as compat

        compat.install()
        compat.setup_distributed()
        gpu = compat.has_accelerator()
        a = recipe.train.attention
        attention = a if a != "auto" else ("simple_flex_attention" if gpu else "sdpa")
        if not gpu and attention == "simple_flex_attention":
            raise BadInput("train.attention simple_flex_attention needs a GPU (no flex backward on CPU): "
                           "use auto or sdpa")
        torch.manual_seed(recipe.train.seed)
        # bf16 states from the store; the draft keeps fp32 master weights. On GPU autocast runs
        # the matmuls in bf16; on CPU we upcast the states so dtypes always agree.
        return cls(gpu, attention, loss_implementation(recipe, gpu), torch.bfloat16 if gpu else torch.float32)


def vocab_mapping(info: dict, store: Store, run_id: str, shape: DraftShape, work: Path | None = None) -> tuple:
    """speculators' d2t/t2d from the loss-masked token counts, and the share of target tokens it covers."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq = token_frequencies(info["manifests"], store, run_id, work / "token-frequencies" if work else None)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), shape.draft_vocab_size, shape.verifier_vocab_size)
    coverage = sum(c for t, c in freq.items() if t2d[t]) / max(1, sum(freq.values()))
    console.print(f"  vocab mapping: {shape.draft_vocab_size} of {shape.verifier_vocab_size} tokens, "
                  f"covering {coverage:.1%} of {sum(freq.values()):,} training target tokens")
    return d2t, t2d, coverage


@dataclass
class TrainData:
    """The samples of each split (shard, local name, manifest entry) and their loaders."""

    items: dict[str, list]
    train_loader: object
    val_loader: object | None
    feed: StreamFeed | None = None  # train.source stream: what the window needs from training

    @classmethod
    def create(cls, recipe: Recipe, store: Store, run_id: str, info: dict, shape: DraftShape, work: Path,
               hs_dtype: torch.dtype) -> TrainData:
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.dataloader import _setup_dataloader
        from speculators.train.distributed import get_local_rank

        from eagle_jobs.train_data import StoreHiddenStatesDataset, staged_name

        if recipe.train.source == "stream":
            return cls.streamed(recipe, store, run_id, info, shape, work, hs_dtype)

        stager = ShardStager(store, run_id, info["manifests"], work / "stage", recipe.train.local_stage_bytes)
        if get_local_rank() == 0:  # one stager per node; the other ranks read what it staged
            stager.start()
        items: dict[str, list[tuple[str, str, dict]]] = {"train": [], "validation": []}
        for m in info["manifests"]:
            (fname, finfo), = m["files"].items()
            for e in m["samples"]:
                if e["loss_tokens"] > 1:
                    items[e["split"]].append((fname, staged_name(fname, finfo), e))
        if not items["train"]:
            raise BadInput(f"run '{run_id}' has no training samples with loss tokens")

        T = recipe.train.total_seq_len

        def loader(split: str):
            if not items[split]:
                return None
            ds = StoreHiddenStatesDataset(store.uri, run_id, items[split], str(stager.root), T, hs_dtype)
            return _setup_dataloader(ds, T, shape.hidden_size, num_workers=recipe.train.num_workers,
                                     num_target_layers=len(recipe.aux_layer_ids), prefetch_factor=4,
                                     preprocess=shift_batch, seed=recipe.train.seed)

        return cls(items, loader("train"), loader("validation"))


    @classmethod
    def streamed(cls, recipe: Recipe, store: Store, run_id: str, info: dict, shape: DraftShape, work: Path,
                 hs_dtype: torch.dtype) -> TrainData:
        """train.source stream: the stream's shards (eagle_jobs.stream), batched in commit order."""
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.dataloader import _setup_dataloader
        from speculators.train.distributed import get_dp_rank, get_dp_size, get_local_rank

        from eagle_jobs import speculators_compat as compat
        from eagle_jobs import stream
        from eagle_jobs.hsformat import bytes_per_token
        from eagle_jobs.train_data import StreamBatchSampler, StreamHiddenStatesDataset

        t, reextract = recipe.train, recipe.train.later_epochs == "re-extract"
        rows = {r.row_id: r for r in info["rows"]}
        bpt = bytes_per_token(len(info["layer_ids"]), info["hidden_size"], info["storage"])
        order = stream.stream_order(list(rows.values()), bpt, recipe.extract.shard_bytes,
                                    first_worker_count(store, run_id), t.epochs if reextract else 1)
        window = recipe.store.window_bytes or 0
        # a step packs samples clipped to total_seq_len, but reads them whole from the store
        stream.check_window(window, max(t.total_seq_len, recipe.limits.max_seq_len) * bpt * get_dp_size())
        groups = stream_groups([s for s in order if s.split == "train" and s.pass_index == 0],
                               window // stream.GROUP_SHARE)
        items: dict[str, list] = {"train": [], "validation": []}
        index_groups: list[list[int]] = []
        for g in groups:
            index_groups.append([])
            for s in g:
                for rid in s.row_ids:
                    if rows[rid].loss_tokens > 1:
                        index_groups[-1].append(len(items["train"]))
                        items["train"].append((s.name, rid, rows[rid].num_tokens))
        for s in order:
            if s.split == "validation":
                items["validation"] += [(s.name, rid, rows[rid].num_tokens) for rid in s.row_ids
                                        if rows[rid].loss_tokens > 1]
        if not items["train"]:
            raise BadInput(f"run '{run_id}' has no training rows with loss tokens")
        names, T = [s.name for s in order], t.total_seq_len
        # the node cache: each shard a later epoch reads again, staged to local disk as it commits (the
        # validation shards, every epoch; the training shards, in keep mode), within train.local_stage_bytes
        again = [s.name for s in order if t.epochs > 1 and (s.split == "validation" or not reextract)]
        stager = ShardStager(store, run_id, stream.committed_in_order(store, run_id, again), work / "stage",
                             t.local_stage_bytes)
        if again and get_local_rank() == 0:  # one stager per node; the other ranks read what it staged
            stager.start()
        ds = StreamHiddenStatesDataset(store.uri, run_id, items["train"], names, str(stager.root), T, hs_dtype)
        sampler = StreamBatchSampler(ds.approx_lengths, index_groups, reextract, T, get_dp_size(), get_dp_rank(),
                                     t.seed)
        layers = len(recipe.aux_layer_ids)
        train = compat.stream_dataloader(ds, sampler, T, shape.hidden_size, t.num_workers, layers, shift_batch)
        val = None
        if items["validation"]:
            vds = StreamHiddenStatesDataset(store.uri, run_id, items["validation"], names, str(stager.root), T,
                                            hs_dtype)
            val = _setup_dataloader(vds, T, shape.hidden_size, num_workers=t.num_workers, num_target_layers=layers,
                                    prefetch_factor=4, preprocess=shift_batch, seed=t.seed)
        console.print(f"  stream: {len(order)} shards planned ({len(groups)} shuffle groups), window "
                      f"{stream.mib(window)}, later epochs {t.later_epochs}")
        feed = StreamFeed(store, run_id, sampler, groups, reextract, window, stream.consumed(store, run_id))
        if get_dp_rank() == 0:  # extraction's window wait tells a slow trainer from a gone one by this mark
            stream.TrainingAlive(store, run_id).start()
        return cls(items, train, val, feed)


def first_worker_count(store: Store, run_id: str) -> int:
    """The extraction's worker count, from its first committed shard's name (waits for one)."""
    from eagle_jobs import stream
    from eagle_jobs.heartbeat import beat
    from eagle_jobs.train_data import wait_committed

    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    started, last = time.monotonic(), None
    while not (keys := stage.store.list(stage.key("manifests"))):
        stream.check_not_failed(store, run_id)
        beat()
        now = time.monotonic()
        if last is None or now - last >= stream.REPORT_S:  # a verifier can take an hour to load
            console.print(f"  stream: waiting for extraction's first shard ({now - started:.0f} s)", markup=False)
            last = now
        time.sleep(stream.POLL_S)
    first = keys[0].rsplit("/", 1)[1].removesuffix(".json")
    wait_committed(store, run_id, first, [first])
    return stream.num_workers_of(first)


def stream_groups(shards: list, group_bytes: int) -> list[list]:
    """Consecutive shards, each group at most group_bytes (at least one shard): shuffled within, and
    finished with (consumed) together."""
    groups: list[list] = []
    size = 0
    for s in shards:
        if not groups or (groups[-1] and size + s.planned_bytes > group_bytes):
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.planned_bytes
    return groups


@dataclass
class StreamFeed:
    """Training's side of the window. Every rank asks `checkpoint_due` after each step (the same answer on
    all: it is computed from the plan): a checkpoint is due once the groups finished since the last one
    hold a quarter of the window (eagle_jobs/stream.py: the window's budget). Rank 0, once a checkpoint
    is committed, marks the shards it is past consumed (re-extract: deletes them), so a restart never
    needs a shard that is gone."""

    store: Store
    run_id: str
    sampler: object
    groups: list[list]
    reextract: bool
    window: int
    marked: set[str]
    _base: tuple[int, int] = (-1, 0)  # (epoch, groups done) at the last checkpoint this feed asked for
    first_step_at: float | None = None  # when this process's first step ended (the overlap with extraction)
    _bytes_before: list[int] = field(default_factory=list)  # planned bytes of groups[:i], built once

    def __post_init__(self) -> None:
        self._bytes_before = list(itertools.accumulate((sum(s.planned_bytes for s in g) for g in self.groups),
                                                       initial=0))

    def _pass(self, epoch: int) -> int:
        return epoch if self.reextract else 0

    def _groups_done(self, epoch: int, steps: int) -> int:
        if not self.reextract and epoch > 0:
            return len(self.groups)
        return self.sampler.groups_done(epoch, steps)  # type: ignore[attr-defined]

    def checkpoint_due(self, epoch: int, step: int) -> bool:
        self.first_step_at = self.first_step_at or time.time()
        if self._base[0] != epoch:  # the first step of this process in the epoch: the last checkpoint is its start
            self._base = (epoch, self._groups_done(epoch, step - 1))
        done = self._groups_done(epoch, step)
        from eagle_jobs.stream import CHECKPOINT_SHARE

        if self._bytes_before[done] - self._bytes_before[self._base[1]] < self.window // CHECKPOINT_SHARE:
            return False
        self._base = (epoch, done)
        return True

    def on_commit(self, epoch: int, local_step: int) -> None:
        from dataclasses import replace

        from eagle_jobs import stream

        done = self._groups_done(epoch, local_step or 1 << 62)  # local step 0: the epoch's end
        p = self._pass(epoch)
        new = [replace(s, name=stream.pass_name(s.name, p)) for g in self.groups[:done] for s in g]
        new = [s for s in new if s.name not in self.marked]
        if new:
            stream.mark_consumed(self.store, self.run_id, new, self.reextract, {"epoch": epoch, "step": local_step})
            self.marked.update(s.name for s in new)


def resume_checkpoint(recipe: Recipe, stage: Stage, ckpt_dir: Path) -> dict | None:
    """Every node restores the newest committed checkpoint of this recipe into ckpt_dir; its manifest, or None."""
    from speculators.train.distributed import get_local_rank, is_distributed

    resumed = None
    if get_local_rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        resumed = restore_latest(stage, ckpt_dir, recipe.train_digest())
        if resumed is not None:
            console.print(f"  resuming from committed {resumed['shard']} (epoch {resumed['epoch']}, "
                          f"step {resumed['local_step'] or 'end'})")
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()  # no rank looks for a checkpoint before it is on disk
    return resumed


def train_record(recipe: Recipe, run_id: str, info: dict, shape: DraftShape, rank: RankSetup, data: TrainData,
                 params: dict, coverage: float, max_steps: int | None) -> dict:
    """train_config.json: what this draft was trained on and with (docs/FORMAT.md)."""
    from speculators.train.distributed import get_world_size

    steps_per_epoch = len(data.train_loader)  # type: ignore[arg-type]
    return {
        "run_id": run_id, "verifier": recipe.verifier.model,
        "samples": {"train": len(data.items["train"]), "validation": len(data.items["validation"])},
        "epochs": recipe.train.epochs, "lr": recipe.train.lr, "scheduler": recipe.train.scheduler,
        "optimizer": recipe.train.optimizer, "world_size": get_world_size(), "steps_per_epoch": steps_per_epoch,
        "total_steps": max_steps or steps_per_epoch * recipe.train.epochs,
        "parameters": params, "draft_shape": shape.describe(),
        "aux_layer_ids": info["layer_ids"][:-1], "attention": rank.attention, "loss_implementation": rank.loss,
        "hidden_states_dtype": str(rank.hs_dtype).removeprefix("torch."), "recipe_digest": recipe.digest(),
        "vocab_coverage": coverage,
        # the images this run's pods ran, when submit pinned them by digest (lineage: promote copies it)
        "image_digests": json.loads(os.environ.get("EAGLE_JOBS_IMAGE_DIGESTS") or "{}"),
    }


def fit_and_export(recipe: Recipe, model, data: TrainData, rank: RankSetup, stage: Stage, work: Path,
                   ckpt_dir: Path, resumed: dict | None, record: dict, max_steps: int | None,
                   started: float) -> None:
    """speculators' Trainer, committing each checkpoint to the store; rank 0 exports the chosen epoch."""
    from speculators.train.distributed import get_rank, maybe_destroy_distributed
    from speculators.train.trainer import TrainerConfig

    from eagle_jobs import speculators_compat as compat

    train_kwargs, val_kwargs = trainer_call_kwargs(recipe, rank.loss)  # ttt_steps, train.loss
    cfg = TrainerConfig(
        num_epochs=recipe.train.epochs, save_path=str(ckpt_dir), resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, hidden_states_dtype=rank.hs_dtype,
        **optimizer_settings(recipe),  # optimizer (Muon's group too), lr, weight decay, schedule, warmup
        log_freq=recipe.train.log_freq, fsdp_shard=recipe.train.fsdp, max_steps=max_steps,
    )
    recorder = compat.MetricsRecorder()
    resumed_metrics = ckpt_dir / str(resumed["epoch"] if resumed else None) / "metrics.json"
    if resumed_metrics.is_file():  # the epochs before a resume: their validation chooses the checkpoint too
        recorder.records = json.loads(resumed_metrics.read_text())
    metrics_log = logging.getLogger("speculators.metrics")
    metrics_log.addHandler(recorder)
    metrics_log.setLevel(logging.INFO)
    board = tensorboard_handler(work / "tensorboard") if get_rank() == 0 else None

    def on_checkpoint(epoch: int, local_step: int) -> None:
        (ckpt_dir / str(epoch) / "train_config.json").write_text(json.dumps(record, indent=1))
        (ckpt_dir / str(epoch) / "metrics.json").write_text(json.dumps(recorder.records))
        m = commit_checkpoint(stage, ckpt_dir, epoch, local_step, {"recipe_digest": recipe.train_digest()})
        prune_step_checkpoints(stage, m)
        prune_local_checkpoints(ckpt_dir, epoch)
        if data.feed is not None:
            data.feed.on_commit(epoch, local_step)
        if board is not None:
            upload_tensorboard(board, work / "tensorboard", stage)

    every = recipe.train.checkpoint_every_minutes
    trainer = compat.StoreTrainer(model, cfg, data.train_loader, data.val_loader, on_checkpoint=on_checkpoint,
                                  checkpoint_every_s=every and every * 60,
                                  checkpoint_due=data.feed.checkpoint_due if data.feed else None)
    try:
        trainer.run_training()  # its CPU warning filters live in compat (adaptation 4)
        if trainer.interrupted:
            maybe_destroy_distributed()
            raise EagleJobsError("train: interrupted by a signal; the checkpoint is committed, rerun to resume",
                                 ExitCode.INTERRUPTED)
        if data.feed is not None:
            record["stream"] = {"first_step_at": data.feed.first_step_at, "consumed_shards": len(data.feed.marked),
                                "window_bytes": data.feed.window, "later_epochs": recipe.train.later_epochs}
        if get_rank() == 0:
            export_selected(recipe, stage, ckpt_dir, record, recorder.records, started)
        if board is not None:
            upload_tensorboard(board, work / "tensorboard", stage)  # the validation of the last epoch too
    finally:  # off the process-wide logger whatever happened: a later run in this process gets its own
        metrics_log.removeHandler(recorder)
        if board is not None:
            metrics_log.removeHandler(board)
            board.close()


def export_selected(recipe: Recipe, stage: Stage, ckpt_dir: Path, record: dict, records: list[dict],
                    started: float) -> None:
    """Export the epoch with the best held-out tau estimate, as vLLM serves it."""
    last = max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and not p.is_symlink())
    record["selection"] = sel = select_epoch(records, estimate_depth(recipe), last)
    record["metrics"] = records
    if not (ckpt_dir / str(sel["epoch"])).is_dir():  # pruned locally once committed: fetch it back
        restore_epoch(stage, ckpt_dir, sel["epoch"])
    if sel["epoch"] != last:
        console.print(f"  exporting epoch {sel['epoch']} (tau estimate {sel['tau_estimate']:.3f}), "
                      f"not the last ({sel['per_epoch'].get(str(last), float('nan')):.3f})")
    record["train_seconds"] = round(time.time() - started, 1)  # this process's, from the shape check
    export_final(stage, ckpt_dir / str(sel["epoch"]), record, recipe)


def tensorboard_handler(log_dir: Path) -> logging.Handler:
    """speculators' own TensorBoard handler on its metric logger: loss, accuracies, lr per step."""
    from speculators.train.logger import TensorBoardHandler

    handler = TensorBoardHandler(log_dir=str(log_dir), run_name="attempt-{utc_time}")  # one per pod attempt
    logging.getLogger("speculators.metrics").addHandler(handler)
    return handler


def upload_tensorboard(handler: logging.Handler, log_dir: Path, stage: Stage) -> None:
    """The event files to <run>/train/data/tensorboard/, beside the checkpoints, on every checkpoint:
    `aws s3 sync` that prefix and point TensorBoard at it. Logs, not a commit: later stages never read them."""
    handler.flush()
    for f in sorted(log_dir.rglob("*")):
        if f.is_file():
            stage.store.put(stage.key(f"data/tensorboard/{f.relative_to(log_dir).as_posix()}"), f.read_bytes())


def export_final(stage: Stage, ckpt: Path, record: dict, recipe: Recipe, meta: dict | None = None) -> None:
    """ckpt (a local epoch directory) as final/: objects first, the manifest last, then COMPLETE.
    meta: more manifest fields (the served selection marks itself there)."""
    from eagle_jobs.speculators_compat import export_checkpoint_dir

    objects = {k: v for k, v in export_checkpoint_dir(ckpt).items() if k in SERVED_FILES}
    objects["train_config.json"] = json.dumps({k: v for k, v in record.items() if k != "metrics"}, indent=1).encode()
    objects["metrics.json"] = json.dumps(record["metrics"]).encode()
    objects["recipe.json"] = json.dumps(recipe.model_dump(mode="json"), indent=1).encode()  # lineage
    stage.commit_shard("final", {f"final/{k}": v for k, v in objects.items()},
                       {"epoch": int(ckpt.name), **(meta or {})})
    stage.complete({"final": stage.store.url(stage.key("data/final"))})
    console.print(f"  final draft: {stage.store.url(stage.key('data/final'))}")
