"""`eagle-jobs compare`: the recipe's variants, each trained on the run's one committed extraction.

A variant overrides only `draft` and `train` (recipe.VariantSpec), so every arm learns from the
same hidden states and is evaluated on the same prompt sets, by the same served tau loop (and
speed measurement) as the run itself: the table differs only where the recipes do. Each arm lives
in <run>/variants/<name>/{train,eval} (layout.train_dir / eval_dir); an arm whose evaluation is
committed is not run again, so a rerun resumes at the first unfinished arm. The table is written
to <run>/compare/data/ as report.json, report.md and compare.png.

Like `pipeline`, this sits above the stages: it calls train and evaluate, they never call it.
"""

from __future__ import annotations

import io
import json
import time

from eagle_jobs.committed import extraction_info
from eagle_jobs.errors import BadInput
from eagle_jobs.layout import COMPARE, eval_dir, train_dir
from eagle_jobs.progress import console
from eagle_jobs.recipe import BASE_VARIANT, Recipe
from eagle_jobs.records import ArmSetResult, CompareArm, CompareReport, EvalReport
from eagle_jobs.store import Stage, Store


def arm_names(recipe: Recipe, only: list[str] | None = None) -> list[str]:
    names = [BASE_VARIANT, *recipe.variants]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise BadInput(f"--variants: {unknown} not in the recipe; choose from {names}")
        names = [n for n in names if n in only]
    return names


def run_arm(recipe: Recipe, store: Store, run_id: str, name: str, train_only: bool = False) -> str:
    """Train and evaluate one arm unless its evaluation is committed; what was done."""
    from eagle_jobs.evaluate.run import run_evaluate
    from eagle_jobs.train.run import run_train

    if Stage(store, run_id, eval_dir(name)).is_complete():
        return "skipped (committed)"
    arm = recipe.variant(name)
    console.rule(f"[bold]variant {name}")
    if not Stage(store, run_id, train_dir(name)).is_complete():
        run_train(arm, store, run_id, variant=name)
    if train_only:  # a train replica of the compare component: the evaluate job measures every arm
        return "trained"
    if arm.train.select_by == "served":  # final/ becomes the best-served epoch before it is evaluated
        from eagle_jobs.epochs import select_served

        select_served(arm, store, run_id, variant=name)
    run_evaluate(arm, store, run_id, variant=name)
    return "done"


def arm_row(store: Store, run_id: str, name: str, recipe: Recipe) -> CompareArm:
    """One line of the table from what the arm committed (its report and training record)."""
    stage, train = Stage(store, run_id, eval_dir(name)), Stage(store, run_id, train_dir(name))
    m, fm = stage.manifest("report"), train.manifest("final")
    assert m is not None and fm is not None, "only arms whose evaluation is complete come here: both are committed"
    report: EvalReport = json.loads(stage.read("report.json", m["files"]["report.json"]))
    record = json.loads(train.read("final/train_config.json", fm["files"]["final/train_config.json"]))
    over = recipe.variants[name].model_dump() if name != BASE_VARIANT else {}
    sets = {set_name: ArmSetResult(
        acceptance_length=s["acceptance_length"], per_position_acceptance=s["per_position_acceptance"],
        num_prompts=s["num_prompts"], baseline_acceptance_length=s["baseline_acceptance_length"],
        speedup=s.get("speedup"), prompts_sha256=s["prompts_sha256"]) for set_name, s in report["prompt_sets"].items()}
    return CompareArm(variant=name, overrides={k: v for k, v in over.items() if v}, prompt_sets=sets,
                      train_seconds=record.get("train_seconds"), epochs=record.get("epochs"),
                      selection=record.get("selection"), teacher_forced_estimate=report.get("teacher_forced_estimate"))


def speedup_at(s: ArmSetResult, concurrency: int) -> float | None:
    """The arm's output-token speedup at one concurrency, where evaluate measured it."""
    table = s.get("speedup")
    for point in table["levels"] if table else []:
        if point["concurrency"] == concurrency:
            return point["speedup"]
    return None


def table_md(rows: list[CompareArm], run_id: str) -> str:
    sets = list(rows[0]["prompt_sets"]) if rows else []
    head = ["variant", "overrides"] + [f"tau {s}" for s in sets] + [f"per position {s}" for s in sets[:1]] \
        + [f"speedup c=1 {s}" for s in sets[:1]] + ["train s"]
    out = [f"# Comparison of run `{run_id}`", "",
           "Every variant trained on the same committed extraction and evaluated on the same prompts "
           "(tau: mean accepted tokens per verifier forward + 1, served by vLLM).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], json.dumps(r["overrides"], separators=(",", ":")) if r["overrides"] else "-"]
        cells += [f"{r['prompt_sets'][s]['acceptance_length']:.3f}" for s in sets]
        cells += [" / ".join(f"{a:.2f}" for a in r["prompt_sets"][s]["per_position_acceptance"]) for s in sets[:1]]
        for s in sets[:1]:
            sp = speedup_at(r["prompt_sets"][s], 1)
            cells.append("-" if sp is None else f"{sp:.2f}x")
        cells.append("-" if r["train_seconds"] is None else f"{r['train_seconds']:.0f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot_png(rows: list[CompareArm]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(rows[0]["prompt_sets"])
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows)), 3.6))
    width = 0.8 / len(sets)
    for i, s in enumerate(sets):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["prompt_sets"][s]["acceptance_length"] for r in rows], width, label=s)
    base = rows[0]["prompt_sets"][sets[0]]["baseline_acceptance_length"]
    if base:
        ax.axhline(base, color="grey", lw=0.8, ls="--", label="untrained draft")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["variant"] for r in rows], rotation=20)
    ax.set_ylim(1.0, None)
    ax.set_ylabel("acceptance length tau")
    ax.legend(fontsize=8)
    ax.set_title("variants on one extraction")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def run_compare(recipe: Recipe, store: Store, run_id: str, only: list[str] | None = None,
                report_only: bool = False, arm_index: int | None = None) -> CompareReport | dict[str, str]:
    """Every arm (or `only` some, or the `arm_index`-th: one train replica on Kubernetes, which
    trains its arm and returns), then the table of every committed arm."""
    if not recipe.variants and not only:
        raise BadInput("compare: the recipe has no `variants:` (name -> overrides of draft/train); add some")
    extraction_info(store, run_id)  # the one extraction every arm trains on: NotReady in one line if missing
    names = arm_names(recipe, only)
    if arm_index is not None:
        if not 0 <= arm_index < len(names):
            raise BadInput(f"compare --arm-index {arm_index}: the recipe has {len(names)} arms {names} "
                           "(set the train job's completions to that count)")
        run_arm(recipe, store, run_id, names[arm_index], train_only=True)
        return {"run_id": run_id, "trained": names[arm_index]}
    status = {}
    for name in names:
        t0 = time.perf_counter()
        status[name] = "not run (--report-only)" if report_only else run_arm(recipe, store, run_id, name)
        console.print(f"  variant {name}: {status[name]} ({time.perf_counter() - t0:.0f}s)")
    every = arm_names(recipe)  # the table has every committed arm, not only those this call ran
    done = [n for n in every if Stage(store, run_id, eval_dir(n)).is_complete()]
    rows = [arm_row(store, run_id, n, recipe) for n in done]
    if not rows:
        raise BadInput(f"compare: no variant of run '{run_id}' has a committed evaluation yet")
    report = CompareReport(run_id=run_id, recipe=recipe.name, variants=rows, missing=sorted(set(every) - set(done)))
    files = {"report.json": json.dumps(report, indent=1).encode(), "report.md": table_md(rows, run_id).encode(),
             "compare.png": plot_png(rows)}
    stage = Stage(store, run_id, COMPARE)
    stage.commit_shard("report", files, {"variants": done})  # rewritten whole by each rerun: one manifest
    console.print(table_md(rows, run_id), soft_wrap=True, markup=False)
    console.print(f"  comparison: {store.url(stage.key('data/report.md'))}")
    return report
