"""The serving config to deploy a draft with, chosen from its speedup surface.

evaluate times every draft length k at every concurrency level against one draft-less server
(report.json `speedup.surface`). Here each measured level gets the k with the highest speedup (the
geometric mean over the timed prompt sets), or no draft where no k reaches 1.0x. The levels become
batch-size ranges: a level c covers the batch sizes above the level below it, up to c; the top
level covers everything above. Where the ranges want more than one k, the config carries vLLM's
batch-size schedule of k, `num_speculative_tokens_per_batch_size` (vllm 0.32
config/speculative.py:491, 0.33 :524; the scheduler picks k by the number of requests it schedules
in a step, v1/core/sched/scheduler.py:1487; a k of 0 drafts nothing, v1/spec_decode/dynamic/utils.py
accepts values >= 0 and carries the last range's k to every larger batch size). Each range's k was
measured on a server fixed at that k; the schedule composes them.

The command is the `vllm serve` evaluate ran (eagle_jobs.serve_plans), with the recommended config
and the draft at DRAFT_PLACEHOLDER; `promote` writes it again with the promoted draft's directory.
"""

from __future__ import annotations

import json
import math
import shlex

from eagle_jobs.recipe import Recipe
from eagle_jobs.records import LevelChoice, ServingAdvice, ServingRange, SpeedTable
from eagle_jobs.serve_plans import speculative_config
from eagle_jobs.vllm_server import ServePlan

DRAFT_PLACEHOLDER = "DRAFT_DIR"
# The last range's end in the schedule: vLLM clamps every range to --max-num-seqs and carries the last
# k beyond it (build_dynamic_sd_schedule_lookup), so any bound at or above it means "and above".
OPEN_END = 65536


def _gains(tables: dict[str, SpeedTable]) -> dict[tuple[int, int], float]:
    """(k, concurrency) -> the geometric mean of its speedup over the sets that timed it."""
    per: dict[tuple[int, int], list[float]] = {}
    for t in tables.values():
        for cell in t["surface"]:
            per.setdefault((cell["k"], cell["concurrency"]), []).append(cell["speedup"])
    return {kc: math.exp(sum(math.log(x) for x in xs) / len(xs)) for kc, xs in per.items()}


def choose(tables: dict[str, SpeedTable]) -> list[LevelChoice]:
    """The fastest k at each measured level, and whether it pays."""
    gains = _gains(tables)
    out: list[LevelChoice] = []
    for c in sorted({c for _k, c in gains}):
        k, g = max(((k, g) for (k, lv), g in sorted(gains.items()) if lv == c), key=lambda kg: kg[1])
        out.append({"concurrency": c, "k": k if g > 1.0 else 0, "best_k": k, "speedup": g})
    return out


def ranges_of(levels: list[LevelChoice]) -> list[ServingRange]:
    """Level c covers the batch sizes above the level below it up to c, the top level all above it;
    adjacent ranges with the same k are one."""
    ranges: list[ServingRange] = []
    below = 0
    for i, lv in enumerate(levels):
        last = None if i == len(levels) - 1 else lv["concurrency"]
        if ranges and ranges[-1]["k"] == lv["k"]:
            ranges[-1]["last"] = last
        else:
            ranges.append({"first": below + 1, "last": last, "k": lv["k"]})
        below = lv["concurrency"]
    return ranges


def config_for(ranges: list[ServingRange], draft: str) -> dict | None:
    ks = {r["k"] for r in ranges}
    if ks == {0}:
        return None
    spec = speculative_config(draft, max(ks))
    if len(ks) > 1:
        spec["num_speculative_tokens_per_batch_size"] = [
            [r["first"], r["last"] if r["last"] is not None else max(OPEN_END, r["first"]), r["k"]] for r in ranges]
    return spec


def as_measured(recipe: Recipe) -> ServingAdvice:
    """Where speed was not measured (evaluate on one given server, evaluate.vllm.endpoint, or the transformers
    backend): the config τ was measured at, k = evaluate.k on evaluate's server, with no claim about where it pays."""
    ev = recipe.evaluate
    spec = speculative_config(DRAFT_PLACEHOLDER, ev.k)
    plan = ServePlan(ev.vllm, recipe.verifier, ("--speculative-config", json.dumps(spec)))
    note = (f"speed not measured: the config τ was measured at (k {ev.k}); whether it pays, and up to which "
            "concurrency, takes the speed pass (`eagle-jobs evaluate` on the vllm backend, no evaluate.vllm.endpoint)")
    return {"by_level": [], "ranges": [], "no_gain_from": None, "speculative_config": spec,
            "command": plan.command(), "env": plan.env({}), "note": note}


def advise(recipe: Recipe, tables: dict[str, SpeedTable | None]) -> ServingAdvice:
    """The config to deploy from the sets' surfaces; where speed was not measured, the config τ was measured at."""
    timed = {n: t for n, t in tables.items() if t and t.get("surface")}
    if not timed:
        return as_measured(recipe)
    levels = choose(timed)
    ranges = ranges_of(levels)
    spec = config_for(ranges, DRAFT_PLACEHOLDER)
    plan = ServePlan(recipe.evaluate.vllm, recipe.verifier, ("--speculative-config", json.dumps(spec)) if spec else ())
    start = ranges[-1]["first"] if ranges[-1]["k"] == 0 else None
    ev = recipe.evaluate
    verdict = ("speculation pays at no measured concurrency: serve without a draft" if spec is None
               else f"no draft from {start} requests in flight" if start
               else "speculation pays at every measured concurrency")
    note = f"k {ev.num_speculative_tokens} at concurrency {ev.concurrency_levels} on {', '.join(timed)}: {verdict}"
    return {"by_level": levels, "ranges": ranges, "no_gain_from": start, "speculative_config": spec,
            "command": plan.command(), "env": plan.env({}), "note": note}


def with_draft(advice: ServingAdvice, draft: str) -> ServingAdvice:
    """The advice with the draft's directory in place of DRAFT_PLACEHOLDER (what promote stores)."""
    spec = advice["speculative_config"]
    new_spec = {**spec, "model": draft} if spec else None
    old, new = json.dumps(spec), json.dumps(new_spec)
    return {**advice, "speculative_config": new_spec,
            "command": [new if a == old else a for a in advice["command"]]}


def serve_line(advice: ServingAdvice) -> str:
    """The shell line: the measured server's environment, then its `vllm serve` command."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(advice["env"].items()))
    return (env + " " if env else "") + shlex.join(advice["command"])
