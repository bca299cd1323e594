"""The evaluate stage: the draft checked against the recipe and its extraction, τ of the draft and of an
untrained one on every prompt set (and the speed pass, on servers this stage starts or a pod's sidecar
switches to), the teacher-forced estimate, and the report committed to the store."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from eagle_jobs.committed import download_final, extraction_info, tau_estimate
from eagle_jobs.deploy import advise
from eagle_jobs.errors import BadInput
from eagle_jobs.evaluate.decode import evaluate_transformers, save_untrained
from eagle_jobs.evaluate.served import evaluate_vllm_sets, speed_at
from eagle_jobs.evaluate.sets import SetMeasurement, eval_sets, max_tokens_of, set_source, within_limits
from eagle_jobs.evaluate.speed import (
    NOT_TIMED,
    SPEED_NOTE,
    own_servers,
    sidecar_switches,
    speed_without_draft,
    speedup_table,
    timed_sets,
)
from eagle_jobs.layout import StageName, content_hash, eval_dir, train_dir
from eagle_jobs.progress import console
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import EngineRecord, EvalReport, PromptSetResult, TimedPass, TrainRecord
from eagle_jobs.serve_plans import sidecar_drafts
from eagle_jobs.store import Stage, Store

STAGE = StageName.EVALUATE.dir


# -- checks before any long work --------------------------------------------------------------
def check_draft_matches(recipe: Recipe, draft_cfg: dict, extraction_layers: list[int] | None, verifier_arch) -> None:
    aux = draft_cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux != recipe.aux_layer_ids:
        raise BadInput(f"draft aux layer ids {aux} != recipe aux_layer_ids {recipe.aux_layer_ids}")
    if extraction_layers is not None and aux != extraction_layers[:-1]:
        raise BadInput(f"draft aux layer ids {aux} != the extraction's {extraction_layers[:-1]}")
    ver = (draft_cfg.get("speculators_config") or {}).get("verifier") or {}
    want = ver.get("architectures")
    if want and verifier_arch and list(want) != list(verifier_arch):
        raise BadInput(f"draft was trained for a {want} verifier, the recipe's verifier is {verifier_arch}")



def teacher_forced_estimate(metrics: list[dict], k: int, epoch: int | None = None) -> float | None:
    """1 + sum_i P(first i+1 draft steps all right), from the validation of `epoch` (the exported one:
    the draft being evaluated), else of the last epoch validated."""
    vals = [m for m in metrics if "val" in m]
    if epoch is not None and any(int(m.get("epoch", -1)) == epoch for m in vals):
        vals = [m for m in vals if int(m.get("epoch", -1)) == epoch]
    if not vals:
        return None
    return tau_estimate(vals[-1]["val"], k)


def measure_draft(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]],
                  timed: bool = False) -> tuple[dict, dict[str, int], dict[str, SetMeasurement]]:
    """One draft's results per set on the recipe's backend: (prompts kept per set, prompts skipped as too
    long per set, results). The transformers backend counts prompt lengths with the verifier's tokenizer
    first; the vLLM backend on its server (served_token_count), where the verifier's own code may run.
    timed (vLLM): the speed pass too (evaluate_vllm_sets)."""
    if recipe.evaluate.backend == "transformers":
        kept, too_long = within_limits(recipe, sets)
        return kept, too_long, {name: evaluate_transformers(recipe, draft_dir, m, untrained=False,
                                                            max_new=max_tokens_of(recipe, name))
                                for name, m in kept.items()}
    res = evaluate_vllm_sets(recipe, draft_dir, sets, timed=timed)
    return ({name: r["prompts"] for name, r in res.items()}, {name: r["skipped_too_long"] for name, r in res.items()},
            res)


def measure_sets(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]], work: Path):
    """τ of the draft and of an untrained one per set, and the speedup per set where it can be measured:
    (prompts kept per set, prompts skipped as too long per set, draft's results, untrained draft's results,
    {"sets": set -> speedup table, "note", "wall_s"}). The long-output set is for τ by position: no
    untrained baseline and no speed pass there."""
    vllm, own = recipe.evaluate.backend == "vllm", own_servers(recipe)
    servers = own or sidecar_switches(recipe)  # the baselines and each k need a server of their own
    sets, too_long, res = measure_draft(recipe, draft_dir, sets, timed=vllm and servers)
    if not vllm:
        base = {name: evaluate_transformers(recipe, draft_dir, m, untrained=True)
                for name, m in timed_sets(sets).items()}
        return sets, too_long, res, base, {
            "sets": {}, "wall_s": None, "note": "not measured: speed is a serving measure, taken on the vllm "
            "backend (the transformers loop runs one request at a time, unbatched)"}
    if not servers:
        return sets, too_long, res, {}, {"sets": {}, "wall_s": None, "note": NOT_TIMED}
    from eagle_jobs.verifier import resolve_path

    # a pod's sidecar serves the untrained draft from the path its prepare named, on the volume they share
    untrained = save_untrained(draft_dir, resolve_path(recipe.verifier, "embeddings"), recipe.train.seed,
                               work / "untrained-draft" if own else sidecar_drafts()[1])
    timed = timed_sets(sets)
    base = evaluate_vllm_sets(recipe, untrained, timed, untrained=True)
    started = time.perf_counter()
    by_k: dict[int, dict[str, dict[int, TimedPass]]] = {recipe.evaluate.k: {}}
    for name in timed:  # measured with the τ pass's server (timed=True above): every timed set has its pass
        passes = res[name].get("speed")
        assert passes is not None, name
        by_k[recipe.evaluate.k][name] = passes
    for k in recipe.evaluate.other_ks():  # a server each, timed only (serve_plans.evaluate_plans' order)
        by_k[k] = speed_at(recipe, draft_dir, timed, k)
    plain = speed_without_draft(recipe, timed)
    wall = time.perf_counter() - started + next(iter(res.values()))["speed_wall_s"]
    return sets, too_long, res, base, {
        "sets": {name: speedup_table({k: s[name] for k, s in by_k.items()}, plain[name], recipe) for name in timed},
        "note": SPEED_NOTE, "wall_s": wall}


def tau_on_this_engine(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]]) -> tuple[EngineRecord, dict]:
    """One draft's τ per set on this process's engine (the recipe's evaluate backend), without baseline or
    speed pass: (engine, {set: {acceptance_length, prompts_sha256}}), what promote --across-engines compares."""
    kept, _, res = measure_draft(recipe, draft_dir, sets)
    return next(iter(res.values()))["engine"], {
        name: {"acceptance_length": r["acceptance_length"], "prompts_sha256": content_hash(kept[name])}
        for name, r in res.items()}


def set_results(recipe: Recipe, prompts: Path | None, sets: dict[str, list[list[dict]]], too_long: dict[str, int],
                res: dict[str, SetMeasurement], base: dict[str, SetMeasurement],
                speed: dict) -> dict[str, PromptSetResult]:
    """Each set's record in report.json, from measure_sets' results."""
    return {name: {
        "acceptance_length": res[name]["acceptance_length"],
        "per_position_acceptance": res[name]["per_position_acceptance"],
        "num_prompts": len(m), "skipped_too_long": too_long[name],
        "tokens_generated": res[name]["tokens_generated"], "verifier_forwards": res[name]["rounds"],
        "max_new_tokens": max_tokens_of(recipe, name), "by_position": res[name].get("by_position"),
        "baseline_acceptance_length": base[name]["acceptance_length"] if name in base else None,
        "baseline_per_position_acceptance": base[name]["per_position_acceptance"] if name in base else None,
        "source": set_source(recipe, name, prompts),
        # what `promote` compares: drafts are ranked only on the same prompts
        "prompts_sha256": content_hash(m),
        # output tokens/s with the draft over without it, per concurrency level (None: not measured)
        "speedup": speed["sets"].get(name),
    } for name, m in sets.items()}


def run_evaluate(recipe: Recipe, store: Store, run_id: str, prompts: Path | None = None,
                 output: Path | None = None, variant: str | None = None) -> EvalReport:
    """tau (and speed) of the run's final draft, or of one `compare` variant's, on every prompt set."""
    from eagle_jobs.verifier import load_config

    sets = eval_sets(recipe, prompts)  # bad prompt files fail here, before any model loads
    work = Path(tempfile.mkdtemp(prefix="eagle-eval-"))
    draft_dir = download_final(store, run_id, work / "draft", variant)
    draft_cfg = json.loads((draft_dir / "config.json").read_text())
    try:
        layers = extraction_info(store, run_id)["layer_ids"]
    except Exception:  # noqa: BLE001 - a draft evaluated without its extraction in this store
        layers = None
    check_draft_matches(recipe, draft_cfg, layers, getattr(load_config(recipe.verifier), "architectures", None))
    train_cfg: TrainRecord = json.loads((draft_dir / "train_config.json").read_text())
    metrics = json.loads((draft_dir / "metrics.json").read_text())
    k = recipe.evaluate.k
    console.print(f"[bold]evaluate[/] k={k}, backend {recipe.evaluate.backend}: "
                  + ", ".join(f"{name} ({len(m)} prompts)" for name, m in sets.items()))
    sets, too_long, res, base, speed = measure_sets(recipe, draft_dir, sets, work)
    per_set = set_results(recipe, prompts, sets, too_long, res, base, speed)
    primary = next(iter(per_set))  # the held-out split when there is one
    p = per_set[primary]
    report: EvalReport = {
        "acceptance_length": p["acceptance_length"], "per_position_acceptance": p["per_position_acceptance"],
        "num_speculative_tokens": k, "num_prompts": p["num_prompts"], "tokens_generated": p["tokens_generated"],
        "verifier_forwards": p["verifier_forwards"], "verifier": recipe.verifier.model,
        "draft": store.url(Stage(store, run_id, train_dir(variant)).key("data/final")),
        "baseline_acceptance_length": p["baseline_acceptance_length"],
        "baseline_per_position_acceptance": p["baseline_per_position_acceptance"],
        "baseline_note": ("the same loop with an untrained draft (same shape, vocab mapping and verifier embeddings)"
                          if base else NOT_TIMED),
        "speedup": p["speedup"], "speedup_note": speed["note"], "speedup_wall_s": speed["wall_s"],
        "speed_ks": recipe.evaluate.num_speculative_tokens,
        "concurrency_levels": recipe.evaluate.concurrency_levels, "min_speedup": recipe.evaluate.min_speedup,
        "position_bucket_tokens": recipe.evaluate.position_bucket_tokens,
        "trained_answer_tokens": recipe.sampling.max_new_tokens,
        "serving": advise(recipe, {name: x["speedup"] for name, x in per_set.items()}),
        "teacher_forced_estimate": teacher_forced_estimate(
            metrics, k, sel["epoch"] if (sel := train_cfg.get("selection")) else None),
        "teacher_forced_note": "1 + sum of the exported epoch's validation full_acc_i: an estimate, not a measurement",
        "backend": recipe.evaluate.backend, "engine": res[primary]["engine"],
        "prompts": primary if not prompts else str(prompts),
        "prompts_sha256": p["prompts_sha256"], "prompt_sets": per_set,
        "train": {"samples": train_cfg.get("samples"), "epochs": train_cfg.get("epochs"),
                  "total_steps": train_cfg.get("total_steps"), "parameters": train_cfg.get("parameters"),
                  "selection": train_cfg.get("selection")},
        "run_id": run_id,
    }
    from eagle_jobs.report import write_report

    files = write_report(report, metrics)
    stage = Stage(store, run_id, eval_dir(variant))
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (output / name).write_bytes(data)
        where = str(output / "report.md")
    else:
        stage.commit_shard("report", files, {"acceptance_length": report["acceptance_length"]})
        stage.complete({"acceptance_length": report["acceptance_length"]})
        where = store.url(stage.key("data/report.md"))
    for name, x in per_set.items():
        # no [brackets]: rich would read them as markup and print nothing of the set's name
        sp = "; speedup " + ", ".join(f"{lv['speedup']:.2f}x at concurrency {lv['concurrency']}"
                                      for lv in x["speedup"]["levels"]) if x["speedup"] else ""
        console.print(f"  {name}: tau = {x['acceptance_length']:.3f} on {x['num_prompts']} prompts (untrained draft: "
                      f"{x['baseline_acceptance_length'] or float('nan'):.3f}){sp}", soft_wrap=True)
    if report["serving"]:
        console.print(f"  serving config: {report['serving']['note']} (report.md, 'Serve this draft')",
                      soft_wrap=True, markup=False, highlight=False)
    console.print(f"  report: {where}")
    return report
