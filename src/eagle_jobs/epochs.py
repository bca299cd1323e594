"""Which epoch to ship: served tau per epoch checkpoint against training's estimate.

train exports the epoch with the best teacher-forced tau estimate (train.checkpoints.select_epoch: 1 + sum of
the held-out full_acc_i). `eagle-jobs rank-epochs` checks that choice against what users get: each
committed epoch checkpoint is exported as vLLM serves it (train.checkpoints.restore_served: the weights and
config final/ would hold), served on the first N prompts of the held-out split with the recipe's
evaluate settings (evaluate.served.evaluate_vllm_sets: one server per epoch, its start included in the
epoch's wall time), and the two rankings are compared by Spearman's rank correlation. Each epoch's
measurement is committed on its own (<run>/[variants/<v>/]epochs/data/epoch-NNNN-<key>.json), so a
rerun serves only what is not committed yet; the report is data/report.json and report.md.

With `train.select_by: served`, `eagle-jobs run` and `eagle-jobs compare` call select_served after
training: the best-served epoch is exported again as final/ (objects first, the manifest last, as
train commits it), its `selection` saying why, before evaluate measures it.

Like `compare` and `pipeline`, this sits above the stages: it calls train and evaluate, they never
call it.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

from eagle_jobs.committed import checkpoint_manifest
from eagle_jobs.errors import BadInput, NotReady
from eagle_jobs.layout import content_hash, epochs_dir, train_dir
from eagle_jobs.progress import console
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import CheckpointManifest, Selection, TrainRecord
from eagle_jobs.settings import settings
from eagle_jobs.store import Stage, Store

# Held-out prompts served per epoch. On the demo's base arm, 8 (6 within limits) ranked epochs 2 and 3
# the other way round from 24 (20), whose tau for epoch 3 equals evaluate's own on those prompts; at
# Kimi scale a verifier load, not the prompts, is the cost (docs/OPERATIONS.md).
DEFAULT_PROMPTS = 24
TRAIN_RECORD = "train-record"  # train's own final/ record, kept before select_served rewrites final/


# -- rank correlation -------------------------------------------------------------------------
def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks, ascending; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho: Pearson's correlation of the average ranks (the definition that holds with
    ties; 1 - 6 sum d^2 / (n (n^2 - 1)) holds only without them). None where it is undefined: fewer
    than two pairs, or one side constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} values against {len(ys)}")
    if len(xs) < 2:
        return None
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


# -- what is ranked, and on what -----------------------------------------------------------------
def check_servable(recipe: Recipe) -> None:
    """Refused before any training: one server per epoch needs servers this process starts."""
    external = recipe.evaluate.vllm.endpoint or settings().vllm_endpoint
    if recipe.evaluate.backend == "vllm" and external:
        raise BadInput("ranking epochs by served tau starts one vLLM server per epoch checkpoint, and an external "
                       "endpoint (evaluate.vllm.endpoint / $EAGLE_JOBS_VLLM_ENDPOINT, the vllm-sidecar component) "
                       "serves one draft: unset it, or set train.select_by: estimate")


def held_out_prompts(recipe: Recipe, n: int) -> tuple[list[list[dict]], int | None]:
    """The first n prompts of the recipe's held-out split, as evaluate sends them (first turns, over-long
    ones skipped and counted: evaluate.sets.within_limits); and how many were skipped. On the vLLM backend
    every epoch's server skips and counts them itself (None here)."""
    from eagle_jobs.evaluate.sets import eval_sets, within_limits

    only_held_out = recipe.evaluate.model_copy(update={"prompt_sets": {}, "num_prompts": n, "long_output": None})
    r = recipe.model_copy(update={"evaluate": only_held_out})
    try:
        sets = eval_sets(r)
    except BadInput:
        sets = {}
    if "validation" not in sets:
        raise BadInput(f"ranking epochs serves the held-out split of {recipe.prompts.source}, and it has none: "
                       "set prompts.validation (a count or a fraction), or train.select_by: estimate")
    if recipe.evaluate.backend == "vllm":  # each epoch's server counts them (evaluate.sets.served_token_count)
        return sets["validation"], None
    kept, skipped = within_limits(r, {"validation": sets["validation"]})
    return kept["validation"], skipped["validation"]


def measurement_key(recipe: Recipe, ckpt: CheckpointManifest, prompts_sha: str) -> str:
    """What one served tau depends on: the checkpoint's served bytes, the prompts, the verifier and the
    evaluate settings that shape generation (not ports or timeouts)."""
    ev = recipe.evaluate
    served = {f: info["sha256"] for f, info in ckpt["files"].items()
              if f.split("/", 1)[1] in ("model.safetensors", "config.json")}
    what = {"draft": served, "prompts": prompts_sha, "recipe": recipe.digest(("verifier", "chat", "limits")),
            "evaluate": [ev.backend, ev.k, ev.max_new_tokens, ev.concurrency, ev.vllm.serve_args]}
    return content_hash(what, 12)


def train_record(store: Store, run_id: str, variant: str | None) -> dict:
    """train's record of the run's final/ (its train_config.json and metrics.json): the copy kept in the
    epochs stage when select_served rewrote final/, else final/ itself."""
    from eagle_jobs.train.checkpoints import epoch_checkpoints

    train = Stage(store, run_id, train_dir(variant))
    kept = Stage(store, run_id, epochs_dir(variant)).manifest(TRAIN_RECORD)
    ckpts = {str(e): m["committed_at"] for e, m in epoch_checkpoints(train).items()}
    if kept is not None and kept.get("checkpoints") == ckpts:
        st = Stage(store, run_id, epochs_dir(variant))
        return json.loads(st.read(f"{TRAIN_RECORD}.json", kept["files"][f"{TRAIN_RECORD}.json"]))
    final = train.manifest("final")
    if not train.is_complete() or final is None:
        what = f"variant '{variant}' of run '{run_id}'" if variant else f"run '{run_id}'"
        raise NotReady(f"training of {what} is not complete in {store.uri}: rank its epochs once "
                       f"`eagle-jobs {'compare' if variant else 'train'}` has committed final/")
    files = final["files"]
    return {"train_config": json.loads(train.read("final/train_config.json", files["final/train_config.json"])),
            "metrics": json.loads(train.read("final/metrics.json", files["final/metrics.json"])),
            "checkpoints": ckpts}


# -- serving one epoch --------------------------------------------------------------------------------
def serve_epoch(recipe: Recipe, train: Stage, ckpt: CheckpointManifest, prompts: list[list[dict]]) -> dict:
    """tau of one epoch checkpoint served on `prompts`, with the recipe's evaluate backend and settings;
    wall_s counts everything that serving it costs: the download, the server's start, the requests."""
    from eagle_jobs.evaluate.decode import evaluate_transformers
    from eagle_jobs.evaluate.served import evaluate_vllm_sets
    from eagle_jobs.train.checkpoints import restore_served

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=f"eagle-epoch-{ckpt['epoch']}-"))
    try:
        draft = restore_served(train, ckpt, work / "draft")
        if recipe.evaluate.backend == "vllm":
            res = evaluate_vllm_sets(recipe, draft, {"validation": prompts})["validation"]
        else:  # transformers: the same greedy chain loop evaluate runs, in this process
            res = evaluate_transformers(recipe, draft, prompts, untrained=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"epoch": ckpt["epoch"], "checkpoint": ckpt["shard"], "served_tau": res["acceptance_length"],
            "per_position_acceptance": res["per_position_acceptance"], "verifier_forwards": res["rounds"],
            "tokens_generated": res["tokens_generated"], "wall_s": round(time.perf_counter() - started, 2),
            "num_prompts": len(res.get("prompts", prompts)), "skipped_too_long": res.get("skipped_too_long"),
            "engine": res["engine"],
            "measured_at": time.time()}


def served_rows(recipe: Recipe, store: Store, run_id: str, variant: str | None,
                prompts: list[list[dict]]) -> list[dict]:
    """One served measurement per committed epoch checkpoint: committed ones are read back, the others
    served now and committed one by one (an interrupted ranking resumes at the next epoch)."""
    from eagle_jobs.train.checkpoints import epoch_checkpoints

    train, stage = Stage(store, run_id, train_dir(variant)), Stage(store, run_id, epochs_dir(variant))
    prompts_sha = content_hash(prompts)
    rows = []
    for epoch, ckpt in sorted(epoch_checkpoints(train).items()):
        shard = f"epoch-{epoch:04d}-{measurement_key(recipe, ckpt, prompts_sha)}"
        m = stage.manifest(shard)
        if m is not None and stage.is_committed(shard):
            row = json.loads(stage.read(f"{shard}.json", m["files"][f"{shard}.json"]))
            console.print(f"  epoch {epoch}: served tau {row['served_tau']:.3f} (committed, not served again)")
            rows.append({**row, "reused": True})
            continue
        console.print(f"  epoch {epoch}: serving {ckpt['shard']} on {len(prompts)} held-out prompts")
        row = {**serve_epoch(recipe, train, ckpt, prompts), "prompts_sha256": prompts_sha}
        stage.commit_shard(shard, {f"{shard}.json": json.dumps(row, indent=1).encode()},
                           {"epoch": epoch, "served_tau": row["served_tau"]})
        console.print(f"  epoch {epoch}: served tau {row['served_tau']:.3f} in {row['wall_s']:.0f} s")
        rows.append({**row, "reused": False})
    if not rows:
        raise NotReady(f"run '{run_id}' has no committed epoch checkpoint in {store.url(train.prefix)}")
    return rows


# -- the ranking --------------------------------------------------------------------------------------
def best_served(rows: list[dict]) -> int:
    """The epoch with the highest served tau; among equals the better estimate, then the earliest."""
    def score(r):
        est = r.get("teacher_forced_estimate")
        return (r["served_tau"], -math.inf if est is None else est, -r["epoch"])

    return max(rows, key=score)["epoch"]


def rank_epochs(recipe: Recipe, store: Store, run_id: str, variant: str | None = None,
                num_prompts: int = DEFAULT_PROMPTS) -> dict:
    """Served tau of every committed epoch checkpoint beside the teacher-forced estimate, their rank
    correlation and what serving cost; committed as <epochs>/data/report.json and report.md."""
    from eagle_jobs.train.checkpoints import estimate_depth, select_epoch

    check_servable(recipe)
    record = train_record(store, run_id, variant)
    prompts, skipped = held_out_prompts(recipe, num_prompts)
    k = estimate_depth(recipe)
    last = record["train_config"].get("epochs", 1) - 1
    estimates = select_epoch(record["metrics"], k, last)["per_epoch"]
    console.print(f"[bold]rank-epochs[/] run '{run_id}'{f' variant {variant}' if variant else ''}: "
                  f"{len(prompts)} held-out prompts per epoch, backend {recipe.evaluate.backend}")
    rows = served_rows(recipe, store, run_id, variant, prompts)
    for r in rows:
        r["teacher_forced_estimate"] = estimates.get(str(r["epoch"]))
    paired = [r for r in rows if r["teacher_forced_estimate"] is not None]
    rho = spearman([r["teacher_forced_estimate"] for r in paired], [r["served_tau"] for r in paired])
    best_est = max(sorted(estimates, key=int), key=lambda e: estimates[e]) if estimates else None
    report = {
        "run_id": run_id, "variant": variant, "backend": recipe.evaluate.backend,
        "num_speculative_tokens": recipe.evaluate.k, "estimate_depth": k,
        "max_new_tokens": recipe.evaluate.max_new_tokens,
        "num_prompts": rows[0].get("num_prompts", len(prompts)) if skipped is None else len(prompts),
        "skipped_too_long": rows[0].get("skipped_too_long") if skipped is None else skipped,
        "prompts": f"the first {num_prompts} of the held-out split of {recipe.prompts.source}",
        "prompts_sha256": rows[0]["prompts_sha256"], "epochs": rows, "spearman": rho,
        "best_served_epoch": best_served(rows), "best_estimate_epoch": None if best_est is None else int(best_est),
        "served_ranking_wall_s": round(sum(r["wall_s"] for r in rows), 2),
        "served_now_wall_s": round(sum(r["wall_s"] for r in rows if not r["reused"]), 2),
        "note": "served tau: 1 + accepted / drafts of greedy requests, one server per epoch checkpoint; "
                "estimate: 1 + sum of training's held-out full_acc_i (teacher forced); wall_s: the epoch's "
                "download, server start and requests",
    }
    report["agree"] = report["best_estimate_epoch"] == report["best_served_epoch"]
    stage = Stage(store, run_id, epochs_dir(variant))
    md = report_md(report)
    stage.commit_shard("report", {"report.json": json.dumps(report, indent=1).encode(), "report.md": md.encode()},
                       {"spearman": rho, "best_served_epoch": report["best_served_epoch"]})  # rewritten whole
    console.print(md, soft_wrap=True, markup=False, highlight=False)
    report["report_path"] = store.url(stage.key("data/report.md"))
    console.print(f"  report: {report['report_path']}")
    return report


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def report_md(report: dict) -> str:
    who = f"run `{report['run_id']}`" + (f", variant `{report['variant']}`" if report["variant"] else "")
    setup = (f"{report['num_prompts']} held-out prompts per epoch ({report['prompts']}), k = "
             f"{report['num_speculative_tokens']}, {report['max_new_tokens']} new tokens, backend {report['backend']}.")
    out = [f"# Epochs of {who}: served tau against the estimate", "", setup, "",
           "| epoch | served tau | per position | estimate | wall s |", "|---|---|---|---|---|"]
    for r in report["epochs"]:
        mark = " *" if r["epoch"] == report["best_served_epoch"] else ""
        out.append(f"| {r['epoch']}{mark} | {r['served_tau']:.3f} | "
                   f"{' / '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} | "
                   f"{_num(r['teacher_forced_estimate'])} | {r['wall_s']:.0f}{' (committed)' if r['reused'] else ''} |")
    summary = (f"Spearman's rank correlation (estimate vs served tau): {_num(report['spearman'])}. "
               f"Best served: epoch {report['best_served_epoch']}; best estimate: epoch {report['best_estimate_epoch']}"
               f" ({'the same' if report['agree'] else 'they differ'}). Served ranking: "
               f"{report['served_ranking_wall_s']:.0f} s in all "
               f"({report['served_now_wall_s']:.0f} s served by this run).")
    out += ["", summary, "", "\\* the epoch `train.select_by: served` exports."]
    return "\n".join(out) + "\n"


# -- train.select_by: served ----------------------------------------------------------------------------
def keep_train_record(store: Store, run_id: str, variant: str | None) -> dict:
    """train's own record, committed to the epochs stage before final/ is rewritten: a rewrite cut short
    (objects replaced, the manifest not yet) is then redone from it rather than from a broken final/."""
    record = train_record(store, run_id, variant)
    stage = Stage(store, run_id, epochs_dir(variant))
    kept = stage.manifest(TRAIN_RECORD)
    if kept is None or kept.get("checkpoints") != record["checkpoints"]:
        stage.commit_shard(TRAIN_RECORD, {f"{TRAIN_RECORD}.json": json.dumps(record).encode()},
                           {"checkpoints": record["checkpoints"]})
    return record


def select_served(recipe: Recipe, store: Store, run_id: str, variant: str | None = None,
                  num_prompts: int = DEFAULT_PROMPTS) -> str:
    """final/ becomes the best-served epoch (rank_epochs); what was done. Skipped once final/ says so."""
    from eagle_jobs.train.checkpoints import epoch_checkpoints, export_final, restore_served

    train = Stage(store, run_id, train_dir(variant))
    final = checkpoint_manifest(train, "final")
    if final is not None and final.get("selected_by") == "served" and train.is_committed("final"):
        return f"skipped (committed: epoch {final['epoch']})"
    check_servable(recipe)
    record = keep_train_record(store, run_id, variant)
    report = rank_epochs(recipe, store, run_id, variant, num_prompts)
    best = report["best_served_epoch"]
    cfg: TrainRecord = record["train_config"]
    served = {str(r["epoch"]): r["served_tau"] for r in report["epochs"]}
    selection: Selection = {
        "epoch": best, "selected_by": "served",
        "by": f"the highest tau vLLM served on {report['num_prompts']} held-out prompts, one server per epoch "
              "checkpoint (train.select_by: served); among equals the better estimate, then the earliest",
        "served_tau": served[str(best)], "per_epoch_served": served,
        "per_epoch": {str(r["epoch"]): r["teacher_forced_estimate"] for r in report["epochs"]},
        "spearman": report["spearman"], "served_ranking_wall_s": report["served_ranking_wall_s"],
        "report": report["report_path"], "estimate_selection": cfg.get("selection"),
        "last_epoch": max(map(int, served)),
    }
    work = Path(tempfile.mkdtemp(prefix="eagle-select-"))
    try:
        ckpt = restore_served(train, epoch_checkpoints(train)[best], work / str(best))
        export_final(train, ckpt, {**cfg, "selection": selection, "metrics": record["metrics"]}, recipe,
                     meta={"selected_by": "served"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    was = sel["epoch"] if (sel := cfg.get("selection")) else None
    console.print(f"  final/ is epoch {best} (served tau {served[str(best)]:.3f}); the estimate chose epoch {was}")
    return f"epoch {best} (estimate: {was})"
