"""`eagle-jobs`: one sub-command per stage, `run` for a whole recipe.

Every failure we can name ends in one line on stderr and an exit code from
eagle_jobs.errors.ExitCode (documented in docs/OPERATIONS.md#exit-codes).
"""

from __future__ import annotations

import errno
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode, Unavailable
from eagle_jobs.settings import settings

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train EAGLE-3 drafts for very large verifiers: capture -> extract -> train -> evaluate. "
                  "Start with `eagle-jobs run --recipe jobs/demo.yaml` (make demo). Pod-internal commands "
                  "(serve-vllm, exec-vllm, guard) are hidden.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"eagle-jobs {version('eagle-jobs')}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """Train EAGLE-3 drafts for very large verifiers: capture -> extract -> train -> evaluate."""

EXIT_CODES = ("Exit codes: 0 done; 1 unexpected error; 2 usage; 3 bad input (recipe, prompts, checkpoint: do not "
              "retry); 4 store unreachable; 5 a server never became healthy; 6 checkpoint vLLM would not load; 7 an "
              "upstream stage not committed yet; 8 no cluster; 9 not better than the promoted draft; 10 disk full; "
              "11 a run of the recipe still running; 12 a pod of the run cannot start; 130 ^C; 143 SIGTERM "
              "(state committed: rerun to resume). docs/OPERATIONS.md#exit-codes")


RecipeOpt = Annotated[Path, typer.Option("--recipe", "-r", help="jobs/<name>.yaml")]
StoreOpt = Annotated[Optional[str], typer.Option("--store",
                                                 help="file://... or s3://bucket/prefix (default: the recipe's)")]


def _run_id_option(value: str | None) -> str | None:
    """--run-id, checked while the command line is parsed: before any recipe, store or server."""
    from eagle_jobs.runid import check_run_id

    return None if value is None else check_run_id(value, "--run-id")


def _run_id_argument(value: str | None) -> str | None:
    from eagle_jobs.runid import check_run_id

    return None if value is None else check_run_id(value, "RUN_ID")


RunOpt = Annotated[Optional[str], typer.Option("--run-id",
                                               help="run id (default: $EAGLE_JOBS_RUN_ID, else the recipe's)",
                                               callback=_run_id_option)]
# status, watch, logs and promote took the run id as an argument before every command took --run-id:
# still accepted, with a one-line notice
RunIdArg = Annotated[Optional[str], typer.Argument(help="the run id, the old way: use --run-id",
                                                   callback=_run_id_argument, show_default=False, metavar="RUN_ID")]
IndexOpt = Annotated[Optional[int], typer.Option("--shard-index", help="this worker (default: $JOB_COMPLETION_INDEX)")]
VariantOpt = Annotated[Optional[str], typer.Option(help="one arm of `compare` (recipe variants)")]
MinSpeedupOpt = Annotated[Optional[float], typer.Option(
    help="require this speedup at concurrency 1 on every prompt set (default: the recipe's evaluate.min_speedup)")]
NumOpt = Annotated[Optional[int], typer.Option("--num-shards",
                                               help="number of workers (default: $EAGLE_JOBS_NUM_SHARDS)")]


def _context(recipe_path: Path, store: str | None, run_id: str | None):
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.store import Store

    recipe = load_recipe(recipe_path, store)  # checks the recipe's store.run_id
    rid = run_id or _env_run_id() or recipe.store.run_id  # before the store is opened: it may write
    st = Store.open(store or settings().store or recipe.store.uri)
    st.check()
    return recipe, st, rid


def _one_run_id(ctx: typer.Context, positional: str | None, option: str | None) -> str:
    """The run a cluster or promote command names: --run-id, else the old positional argument (with a
    notice), else $EAGLE_JOBS_RUN_ID."""
    command = ctx.command_path.removeprefix("eagle-jobs ")
    if positional and option and positional != option:
        raise BadInput(f"{command}: run id '{positional}' as an argument and '{option}' as --run-id: give one")
    if positional and not option:
        print(f"eagle-jobs {command}: the run id as an argument is the old way: use --run-id {positional}",
              file=sys.stderr)
    rid = option or positional or _env_run_id()
    if not rid:
        print(_usage_line("Missing option '--run-id'.", ctx), file=sys.stderr)
        raise typer.Exit(int(ExitCode.USAGE))
    return rid


def _env_run_id() -> str | None:
    from eagle_jobs.runid import check_run_id

    value = settings().run_id
    return check_run_id(value, "$EAGLE_JOBS_RUN_ID") if value else None


def _arm(recipe, variant: str | None):
    """A variant of the recipe's `variants:`; a rank of a variant gets its arm's recipe already applied."""
    return recipe.variant(variant) if variant and recipe.variants else recipe


@app.command(epilog=EXIT_CODES)
def capture(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
            shard_index: IndexOpt = None, num_shards: NumOpt = None):
    """Stage 1: regenerate every assistant turn with the verifier; commit exact token ids.

    Writes <store>/<run>/capture/ (rows as JSONL shards, manifests, rejects.json).
    Example: eagle-jobs capture --recipe jobs/demo.yaml
    """
    from eagle_jobs.capture import run_capture

    r, st, rid = _context(recipe, store, run_id)
    run_capture(r, st, rid, shard_index, num_shards)


@app.command(epilog=EXIT_CODES)
def extract(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
            shard_index: IndexOpt = None, num_shards: NumOpt = None):
    """Stage 2: hidden states at the aux layers and the final layer, bf16 (or fp8), sharded.

    Writes <store>/<run>/extract/ (safetensors shards and manifests).
    Example: eagle-jobs extract --recipe jobs/demo.yaml --shard-index 0 --num-shards 2
    """
    from eagle_jobs.extract import run_extract

    r, st, rid = _context(recipe, store, run_id)
    run_extract(r, st, rid, shard_index, num_shards)


@app.command(epilog=EXIT_CODES)
def train(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
          max_steps: Annotated[Optional[int], typer.Option(help="stop after this many steps (smoke checks)")] = None,
          variant: VariantOpt = None):
    """Stage 3: train the EAGLE-3 draft with speculators on the committed hidden states.

    Writes <store>/<run>/train/ (epoch and step checkpoints, final/: the draft vLLM serves).
    Example: eagle-jobs train --recipe jobs/demo.yaml
    """
    from eagle_jobs.train.run import run_train

    r, st, rid = _context(recipe, store, run_id)
    run_train(_arm(r, variant), st, rid, max_steps=max_steps, variant=variant)


@app.command(epilog=EXIT_CODES)
def evaluate(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
             prompts: Annotated[Optional[Path], typer.Option(help="prompt file in the capture input format")] = None,
             output: Annotated[Optional[Path], typer.Option(help="write the report here instead of the store")] = None,
             variant: VariantOpt = None):
    """Stage 4: acceptance length under greedy chain speculative decoding, by output position, and the
    speedup per draft length and concurrency with the serving config it recommends.

    Writes <store>/<run>/eval/data/ (report.json, report.md and its plots), or --output.
    Example: eagle-jobs evaluate --recipe jobs/demo.yaml
    """
    from eagle_jobs.evaluate.run import run_evaluate

    r, st, rid = _context(recipe, store, run_id)
    arm = _arm(r, variant)
    if arm.train.select_by == "served" and prompts is None and output is None:  # as `run` does before evaluate
        from eagle_jobs.epochs import select_served  # (with a vLLM sidecar: refused in one line, exit 3)

        select_served(arm, st, rid, variant=variant)
    run_evaluate(arm, st, rid, prompts=prompts, output=output, variant=variant)


@app.command(epilog=EXIT_CODES)
def run(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
        stages: Annotated[Optional[str], typer.Option(help="comma-separated subset, e.g. train,evaluate")] = None):
    """Every stage in order; each is skipped when already committed for this run id.

    Writes what each stage writes, under <store>/<run>/.
    Example: eagle-jobs run --recipe jobs/demo.yaml --run-id try-2
    """
    from eagle_jobs.pipeline import run_pipeline

    r, st, rid = _context(recipe, store, run_id)
    run_pipeline(r, st, rid, stages.split(",") if stages else None)


@app.command(epilog=EXIT_CODES)
def compare(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
            variants: Annotated[Optional[str], typer.Option(help="comma-separated subset (base = the recipe)")] = None,
            report_only: Annotated[bool, typer.Option(help="only write the table of what is committed")] = False,
            arm_index: Annotated[Optional[int], typer.Option(
                help="train only this arm (base first, then the variants in recipe order): one replica each")] = None):
    """Train and evaluate the recipe's variants on the run's committed extraction; one table.

    Writes <store>/<run>/variants/<name>/ per arm and <store>/<run>/compare/data/report.md.
    Example: eagle-jobs compare --recipe jobs/demo.yaml --variants lk,qwen3
    """
    from eagle_jobs.compare import run_compare

    r, st, rid = _context(recipe, store, run_id)
    run_compare(r, st, rid, variants.split(",") if variants else None, report_only=report_only, arm_index=arm_index)


@app.command("rank-epochs", epilog=EXIT_CODES)
def rank_epochs(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None, variant: VariantOpt = None,
                num_prompts: Annotated[Optional[int], typer.Option(
                    min=1, help="held-out prompts served per epoch (default 24: epochs.DEFAULT_PROMPTS)")] = None):
    """Serve every committed epoch checkpoint on the first held-out prompts: served tau per epoch against
    training's estimate, their rank correlation and the time it took (<run>/epochs/data/report.md)."""
    from eagle_jobs.epochs import DEFAULT_PROMPTS
    from eagle_jobs.epochs import rank_epochs as rank

    r, st, rid = _context(recipe, store, run_id)
    rank(_arm(r, variant), st, rid, variant=variant, num_prompts=num_prompts or DEFAULT_PROMPTS)


def _scales(text: Optional[str]) -> Optional[list[int]]:
    from eagle_jobs.plan_scale import parse_scales

    try:
        return parse_scales(text) if text is not None else None
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


ScaleOpt = Annotated[Optional[str], typer.Option(
    "--scale", help="conversation counts, e.g. 10000,100000,1000000 (or 10k,100k,1M): GPU-hours per stage, store "
    "bytes, traffic and wall time for each, stored vs streaming vs re-extract (a markdown table)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the plan (or the --scale table) as JSON")]


@app.command(epilog=EXIT_CODES)
def plan(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None, scale: ScaleOpt = None,
         as_json: JsonOpt = False):
    """Estimate tokens, bytes, objects, traffic and time per stage before booking GPUs.

    With --store, also what capture and extract would reuse from other runs there. With --scale, what
    corpora of those sizes would cost in each data mode (docs/OPERATIONS.md#anchor-scale-runs).
    """
    from eagle_jobs.plan import print_plan
    from eagle_jobs.plan_scale import print_scale
    from eagle_jobs.recipe_file import load_recipe

    conversations = _scales(scale)  # a bad list is refused before the recipe is read
    r = load_recipe(recipe, store)
    if conversations:
        print_scale(r, conversations, as_json)
        return
    rid = run_id or _env_run_id() or r.store.run_id
    print_plan(r, _store_or_none(store), rid, as_json)


prompts_app = typer.Typer(no_args_is_help=True, help="Prompt sets: build the mix a run reads.")
app.add_typer(prompts_app, name="prompts")


@prompts_app.command("build", epilog=EXIT_CODES)
def prompts_build(
        out: Annotated[str, typer.Option(help="the JSONL to write: a path, a URI (s3://...), or "
                                              "store:prompts/<name>.jsonl as prompts.source names it")],
        size: Annotated[int, typer.Option(help="conversations in the mix")],
        source: Annotated[list[str], typer.Option(help="a prompt set (JSONL, JSON, Parquet, pypi://, hf://), "
                                                       "optionally =<weight>; repeat for a mix")],
        store: StoreOpt = None):
    """Build a deduplicated prompt mix of --size conversations from --source sets, streamed.

    Example: eagle-jobs prompts build --size 600000 --source sharegpt.json=1 --source ultrachat.jsonl=2
    --source open-perfectblend.jsonl=3 --out store:prompts/kimi-k2.5-prompts.jsonl  (with $EAGLE_JOBS_STORE set)

    Writes OpenAI `messages` JSONL and `<out>.manifest.json` (sources, counts, duplicates, rejected rows
    by reason, sha256). Exit 3 when the sources hold fewer new, valid conversations than --size (nothing
    is written), 4 when the store cannot be used.
    """
    from eagle_jobs.prompt_mix import build_mix, parse_source
    from eagle_jobs.store import resolve_ref

    out = resolve_ref(out, store or settings().store)
    m = build_mix([parse_source(s) for s in source], size, out)
    for s in m["sources"]:
        print(f"  {s['source']}: {s['taken']:,} taken of {s['rows_read']:,} read ({s['duplicates']:,} duplicates, "
              f"{s['rejected']:,} rejected)")
    print(f"prompts build: {m['conversations']:,} conversations -> {out} (sha256 {m['sha256'][:16]}...)")


recipe_app = typer.Typer(no_args_is_help=True, help="Recipes: check one, show one resolved, print the reference.")
app.add_typer(recipe_app, name="recipe")


def _recipe_and_stated(path: Path):
    import yaml

    from eagle_jobs.recipe_file import load_recipe

    recipe = load_recipe(path)  # a missing or unreadable file is refused here
    return recipe, yaml.safe_load(path.read_text())


@recipe_app.command("check", epilog=EXIT_CODES)
def recipe_check(recipe: RecipeOpt):
    """Check a recipe without starting anything: every key against the schema, then the aux layers and the
    draft's shape against the verifier's config (or verifier.num_layers and the draft keys where it is remote).

    Example: eagle-jobs recipe check --recipe jobs/qwen3-8b.yaml

    Writes nothing. Prints one line: the aux layers (stated or derived) and the draft's shape; exit 3 with the
    key and the reason when the recipe cannot run.
    """
    from eagle_jobs.recipe_view import check_line

    print(check_line(*_recipe_and_stated(recipe)))


@recipe_app.command("show", epilog=EXIT_CODES)
def recipe_show(recipe: RecipeOpt):
    """Print the recipe resolved: every default filled in, the aux layers, the draft's shape, the storage dtype
    and the plan's time per stage (`eagle-jobs plan` for the whole estimate).

    Example: eagle-jobs recipe show --recipe jobs/demo.yaml

    Writes nothing. The YAML it prints is itself a recipe that runs the same here (the backends are resolved
    on this machine: vllm where it is reachable).
    """
    from eagle_jobs.recipe_view import show_text

    print(show_text(*_recipe_and_stated(recipe)))


@recipe_app.command("reference", epilog=EXIT_CODES)
def recipe_reference(out: Annotated[Optional[Path], typer.Option(help="write it here (default: print it)")] = None):
    """Print every recipe key with its type, default, bounds and meaning, from the schema (docs/RECIPE.md).

    Example: eagle-jobs recipe reference --out docs/RECIPE.md

    Writes --out when given.
    """
    from eagle_jobs.recipe_view import reference_markdown

    text = reference_markdown()
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)


@app.command(epilog=EXIT_CODES)
def inspect(checkpoint: Annotated[str, typer.Argument(help="checkpoint directory or store URI")],
            reference: Annotated[Optional[Path], typer.Option(help="reference config.json to compare with")] = None,
            verifier_layers: Annotated[Optional[int],
                                       typer.Option(help="verifier layer count (default: from its config)")] = None):
    """Print a draft checkpoint and check it against what vLLM's EAGLE-3 loader needs. Writes nothing.

    Example: eagle-jobs inspect file://./store/demo/train/data/final
    """
    from eagle_jobs.checkpoint_check import run_inspect

    code = run_inspect(checkpoint, reference=reference, verifier_layers=verifier_layers)
    raise typer.Exit(int(code))


NsOpt = Annotated[str, typer.Option("--namespace", "-n", help="namespace of the pipeline")]
KubeOpt = Annotated[Optional[str], typer.Option("--kubeconfig",
                                                help="kubeconfig file (default: $KUBECONFIG, in-cluster)")]


@app.command(epilog=EXIT_CODES)
def submit(overlay: Annotated[Path, typer.Option(help="k8s/overlays/<name>")],
           run_id: Annotated[str, typer.Option("--run-id", help="this run's id: JobSet name, labels, store path",
                                               callback=_run_id_option)],
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

    run_id = _one_run_id(ctx, run, run_id)
    api = cluster.api_client(kubeconfig)
    st = _store_or_none(store)
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

    run_id = _one_run_id(ctx, run, run_id)
    code = cluster.watch(cluster.api_client(kubeconfig), namespace, run_id, timeout, _store_or_none(store),
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

    run_id = _one_run_id(ctx, run, run_id)
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
    from eagle_jobs.store import resolve_ref

    st = _store_or_none(store)
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
    from eagle_jobs.store import resolve_ref

    run_id = _one_run_id(ctx, run, run_id)
    st = _store_or_none(store)
    if st is None:
        raise typer.BadParameter("--store (or $EAGLE_JOBS_STORE) is required")
    digests = dict(d.split("=", 1) for d in image_digest or [])
    do_promote(st, run_id, resolve_ref(to, st.uri), tolerance, digests, min_speedup, across_engines)


def _store_or_none(uri: str | None):
    from eagle_jobs.store import Store

    uri = uri or settings().store
    if not uri:
        return None
    st = Store.open(uri)
    st.check()
    return st


@app.command("mirror-verifier", epilog=EXIT_CODES)
def mirror_verifier(recipe: RecipeOpt):
    """Copy the verifier at its pinned revision into verifier.weights, once (resumable; a no-op when done).

    Every vLLM pod then streams the weights from the store instead of downloading them from the hub.
    """
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.weights import mirror

    mirror(load_recipe(recipe).verifier)


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
    from eagle_jobs.vllm_switch import PreparedPlans

    r, st, rid = _context(recipe, store, run_id)
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
        _exec(prepared[first]["argv"], prepared[first]["env"])


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
    from eagle_jobs.vllm_switch import PreparedPlans, supervise

    prepared = PreparedPlans.read(command_file)
    if len(prepared.plans) > 1:
        raise typer.Exit(supervise(command_file))
    only = prepared.plans[prepared.first]
    _exec(only["argv"], only["env"])


def _exec(cmd: list[str], env: dict[str, str]) -> None:
    from eagle_jobs.vllm_server import executable

    exe = executable(cmd[0])
    if exe is None:
        raise Unavailable("vllm is not installed in this image: the vLLM sidecar runs it")
    os.execve(exe, cmd, {**os.environ, **env})


def _click_errors() -> tuple[type[Exception], ...]:
    """click's exception types. typer >= 0.24 carries its own copy of click (typer._click), whose
    exceptions derive from typer.TyperException, not click.ClickException: checking only the latter
    let every usage error escape as a traceback."""
    import click

    return (click.ClickException, *(t for t in [getattr(typer, "TyperException", None)] if t is not None))


def _usage_line(e: Exception | str, ctx=None) -> str:
    """One line: what was wrong, the command's usage, where the help is."""
    ctx = ctx or getattr(e, "ctx", None)
    what = e if isinstance(e, str) else e.format_message() if hasattr(e, "format_message") else str(e)
    if ctx is None:
        return f"eagle-jobs: error: {what}"
    return (f"eagle-jobs: error: {what} (usage: {ctx.get_usage().removeprefix('Usage: ').strip()}; "
            f"try '{ctx.command_path} --help')")


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # click returns typer.Exit's code instead of raising it
        if rc == ExitCode.CANCELLED:  # typer turns ^C (KeyboardInterrupt) into Exit(130), which click returns
            print("eagle-jobs: interrupted", file=sys.stderr)
        sys.exit(rc if isinstance(rc, int) else 0)
    except EagleJobsError as e:
        print(f"eagle-jobs: error: {e}", file=sys.stderr)
        if "EAGLE_JOBS_RANK_EXITS" in os.environ:  # a training rank: tell the launcher (train.launch.launch_ranks)
            from eagle_jobs.train.launch import record_rank_exit

            record_rank_exit(e.code)
        sys.exit(int(e.code))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("eagle-jobs: interrupted", file=sys.stderr)
        sys.exit(int(ExitCode.CANCELLED))
    except _click_errors() as e:
        # bare `eagle-jobs`: the help is the answer (the error's show() prints it)
        if type(e).__name__ == "NoArgsIsHelpError" and hasattr(e, "show"):
            e.show()
            sys.exit(int(ExitCode.USAGE))
        print(_usage_line(e), file=sys.stderr)
        sys.exit(int(ExitCode.USAGE) if getattr(e, "exit_code", 2) == 2 else int(ExitCode.BAD_INPUT))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {e.filename}" if e.filename else ""
        print(f"eagle-jobs: error: no space left on a disk{where} ({e.strerror}): free space on the store's disk, "
              "the work dir or the scratch dir (df -h), then rerun: committed shards are kept", file=sys.stderr)
        sys.exit(int(ExitCode.NO_SPACE))
    except Exception as e:
        if type(e).__module__.split(".")[0] == "urllib3":  # the cluster's API server did not answer
            print(f"eagle-jobs: error: cluster API unreachable ({type(e).__name__}: {str(e).splitlines()[0]}): "
                  "check --kubeconfig / $KUBECONFIG and the network", file=sys.stderr)
            sys.exit(int(ExitCode.NO_CLUSTER))
        raise


if __name__ == "__main__":
    main()
