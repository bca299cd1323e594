"""The cluster's commands: submit a run, follow it, reconcile and promote its draft, mirror the verifier."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle_jobs.cli.app import (
    EXIT_CODES,
    MinSpeedupOpt,
    RecipeOpt,
    RunIdArg,
    RunOpt,
    StoreOpt,
    app,
    one_run_id,
    run_id_option,
    store_or_none,
)
from eagle_jobs.errors import BadInput

NsOpt = Annotated[str, typer.Option("--namespace", "-n", help="namespace of the pipeline")]
KubeOpt = Annotated[Optional[str], typer.Option("--kubeconfig",
                                                help="kubeconfig file (default: $KUBECONFIG, in-cluster)")]


@app.command(epilog=EXIT_CODES)
def submit(overlay: Annotated[Path, typer.Option(help="k8s/overlays/<name>")],
           run_id: Annotated[str, typer.Option("--run-id", help="this run's id: JobSet name, labels, store path",
                                               callback=run_id_option)],
           recipe: Annotated[Optional[Path], typer.Option(help="replace the overlay's recipe")] = None,
           kubeconfig: KubeOpt = None,
           image: Annotated[Optional[list[str]], typer.Option(
               help="capture|extract|train=<registry/name>@sha256:<digest>: run this build (repeatable)")] = None):
    """Render the overlay for one run id and server-side apply it; returns at once.

    Writes the run's JobSet and ConfigMap to the cluster.
    Example: eagle-jobs submit --overlay k8s/overlays/full --run-id ci-42
    """
    from eagle_jobs.cluster import submit as do_submit

    images = {}
    for item in image or []:
        name, sep, ref = item.partition("=")
        if not sep:
            raise BadInput(f"--image {item}: expected <stage image>=<ref>@sha256:<digest>")
        images[name] = ref
    do_submit(overlay, run_id, recipe, kubeconfig, images or None)


@app.command(epilog=EXIT_CODES)
def status(ctx: typer.Context, run: RunIdArg = None, run_id: RunOpt = None,
           namespace: NsOpt = "eagle-jobs", kubeconfig: KubeOpt = None,
           store: StoreOpt = None):
    """Per-stage state, extraction indexes done/failed, and progress read from the store.

    Example: eagle-jobs status --run-id demo --store file://./store
    """
    from eagle_jobs import cluster

    run_id = one_run_id(ctx, run, run_id)
    api = cluster.api_client(kubeconfig)
    st = store_or_none(store)
    states = cluster.stage_states(api, namespace, run_id)
    cluster.print_status(states, cluster.store_progress(st, run_id) if st else None)
    if states["state"] == "NotFound":
        raise typer.Exit(int(cluster.WatchExit.GONE))


@app.command(epilog=EXIT_CODES)
def watch(ctx: typer.Context, run: RunIdArg = None, run_id: RunOpt = None,
          namespace: NsOpt = "eagle-jobs", kubeconfig: KubeOpt = None,
          store: StoreOpt = None, timeout: Annotated[Optional[float], typer.Option(help="seconds")] = None,
          heartbeat: Annotated[Optional[float], typer.Option(
              help="seconds between 'still running' lines (default 600)")] = None):
    """Follow a run to its end: exit 0 only on success, a distinct code per kind of failure.

    Example: eagle-jobs watch --run-id ci-42 --timeout 86400
    """
    from eagle_jobs import cluster

    run_id = one_run_id(ctx, run, run_id)
    code = cluster.watch(cluster.api_client(kubeconfig), namespace, run_id, timeout, store_or_none(store),
                         heartbeat_s=heartbeat or cluster.HEARTBEAT_S)
    print(f"eagle-jobs: run {run_id}: {code.name.lower()}", file=sys.stderr)
    raise typer.Exit(int(code))


@app.command(epilog=EXIT_CODES)
def logs(ctx: typer.Context, run: RunIdArg = None, run_id: RunOpt = None,
         namespace: NsOpt = "eagle-jobs", kubeconfig: KubeOpt = None,
         stage: Annotated[Optional[str], typer.Option(help="capture, extract, train or evaluate")] = None,
         tail: Annotated[Optional[int], typer.Option(help="last N lines per pod")] = None):
    """The worker logs of a run's pods.

    Example: eagle-jobs logs --run-id demo --stage train --tail 50
    """
    from eagle_jobs import cluster

    run_id = one_run_id(ctx, run, run_id)
    print(cluster.logs(cluster.api_client(kubeconfig), namespace, run_id, stage, tail))


@app.command(epilog=EXIT_CODES)
def reconcile(to: Annotated[str, typer.Option("--to", help="store:drafts/<name>, or any store URI")],
              store: StoreOpt = None,
              prefix: Annotated[str, typer.Option(help="only run ids that start with this (ci-)")] = "",
              tolerance: Annotated[float, typer.Option(help="a tie within this much tau still promotes")] = 0.01,
              min_speedup: MinSpeedupOpt = None,
              summary: Annotated[Optional[Path], typer.Option(
                  help="append a Markdown summary here ($GITHUB_STEP_SUMMARY)")] = None):
    """Decide every finished run once: promote it if at least as good (the scheduled half of CI).

    Writes <to>/decisions/<run-id>.json per run decided, and what promote writes.
    Example: eagle-jobs reconcile --to store:drafts/kimi-k2.5 --prefix ci-  (with $EAGLE_JOBS_STORE set)
    """
    from eagle_jobs.promote import reconcile as do_reconcile
    from eagle_jobs.store_refs import resolve_ref

    st = store_or_none(store)
    if st is None:
        raise typer.BadParameter("--store (or $EAGLE_JOBS_STORE) is required")
    decided = do_reconcile(st, resolve_ref(to, st.uri), prefix, tolerance, min_speedup)
    if summary is not None:
        with open(summary, "a") as f:
            f.write("## Finished runs\n\n" if decided else "## Finished runs\n\nnone since the last pass\n")
            for d in decided:
                f.write(f"{d['summary']}\n**{'promoted' if d['promoted'] else 'not promoted'}**: {d['why']}\n\n")


@app.command(epilog=EXIT_CODES)
def promote(ctx: typer.Context, to: Annotated[str, typer.Option("--to", help="store:drafts/<name>, or any store URI")],
            run: RunIdArg = None, run_id: RunOpt = None,
            store: StoreOpt = None,
            tolerance: Annotated[float, typer.Option(help="a tie within this much tau still promotes")] = 0.01,
            min_speedup: MinSpeedupOpt = None,
            image_digest: Annotated[Optional[list[str]], typer.Option(help="stage=sha256:... (repeatable)")] = None,
            across_engines: Annotated[bool, typer.Option(
                "--across-engines", help="against a draft measured on another engine (vLLM version, runner, "
                "sampling), measure both again here and compare those")] = False):
    """Copy a run's draft to a stable place only if its tau beats (or ties) the promoted one, with the
    recommended `vllm serve` line (versions/<run-id>/serve.json, CURRENT.json).

    Example: eagle-jobs promote --run-id demo --store file://./store --to store:drafts/demo
    """
    from eagle_jobs.promote import promote as do_promote
    from eagle_jobs.store_refs import resolve_ref

    run_id = one_run_id(ctx, run, run_id)
    st = store_or_none(store)
    if st is None:
        raise typer.BadParameter("--store (or $EAGLE_JOBS_STORE) is required")
    digests = dict(d.split("=", 1) for d in image_digest or [])
    do_promote(st, run_id, resolve_ref(to, st.uri), tolerance, digests, min_speedup, across_engines)


@app.command("mirror-verifier", epilog=EXIT_CODES)
def mirror_verifier(recipe: RecipeOpt):
    """Copy the verifier at its pinned revision into verifier.weights, once (resumable; a no-op when done).

    Every vLLM pod then streams the weights from the store instead of downloading them from the hub.
    """
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.weights import mirror

    mirror(load_recipe(recipe).verifier)
