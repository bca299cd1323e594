"""Pod-internal commands, run by the manifests, not by people: the vLLM sidecar's prepare and exec, the
run's guard."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle_jobs.cli.app import (
    EXIT_CODES,
    IndexOpt,
    RecipeOpt,
    RunOpt,
    StoreOpt,
    app,
    context,
)


@app.command("serve-vllm", hidden=True, epilog=EXIT_CODES)
def serve_vllm(recipe: RecipeOpt,
               stage: Annotated[str, typer.Option(help="capture, extract or evaluate")],
               store: StoreOpt = None, run_id: RunOpt = None, shard_index: IndexOpt = None,
               dry_run: Annotated[bool, typer.Option(help="print the commands instead of running one")] = False,
               write: Annotated[Optional[Path], typer.Option(
                   help="write the stage's plans as JSON for `exec-vllm` instead of running the first")] = None):
    """Exec `vllm serve` with exactly the arguments a stage needs (evaluate: its first server).

    In a pod, `--write` runs in a regular init container: every check that can fail (recipe, store,
    the draft's download) fails there, with its exit code, before vLLM's restartable sidecar starts.
    It writes every server the stage starts (evaluate's several: eagle_jobs.vllm_switch).
    """
    from eagle_jobs.serve_plans import stage_plans
    from eagle_jobs.vllm_server import with_shutdown_timeout
    from eagle_jobs.vllm_switch import PreparedPlans, exec_plan

    r, st, rid = context(recipe, store, run_id)
    plans = stage_plans(r, stage, st, rid, shard_index)
    prepared: dict[str, dict] = {}
    for name, plan in plans.items():
        cmd = plan.command() if len(plans) == 1 else with_shutdown_timeout(plan.command())  # stopped to switch
        prepared[name] = {"argv": cmd, "env": {k: v for k, v in plan.env(os.environ).items() if os.environ.get(k) != v}}
    first = next(iter(prepared))
    if dry_run:
        for name, p in prepared.items():
            print(("" if len(prepared) == 1 else f"# {name}\n")
                  + shlex.join([*(f"{k}={v}" for k, v in sorted(p["env"].items())), *p["argv"]]))
    elif write is not None:
        PreparedPlans(prepared, first).write(write)
    else:
        exec_plan(prepared[first])


@app.command("guard", hidden=True)
def guard_run(jobset: Annotated[str, typer.Option(envvar="JOBSET_NAME", help="the run's JobSet")],
              namespace: Annotated[str, typer.Option(envvar="POD_NAMESPACE")] = "eagle-jobs"):
    """The run's guard pod: fail the run (exit 12) once one of its pods cannot start; exit 0 when the stages succeed."""
    from eagle_jobs import cluster
    from eagle_jobs.cluster.guard import guard

    guard(cluster.api_client(), namespace, jobset)


@app.command("exec-vllm", hidden=True, epilog=EXIT_CODES)
def exec_vllm(command_file: Annotated[Path, typer.Argument(help="what `serve-vllm --write` wrote")]):
    """The pod's vLLM sidecar: exec the prepared `vllm serve` command, with nothing left to check; of several
    (evaluate), serve the one the worker asks for (eagle_jobs.vllm_switch)."""
    from eagle_jobs.vllm_switch import PreparedPlans, exec_plan, supervise

    prepared = PreparedPlans.read(command_file)
    if len(prepared.plans) > 1:
        raise typer.Exit(supervise(command_file))
    exec_plan(prepared.plans[prepared.first])
