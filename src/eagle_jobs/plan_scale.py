"""`eagle-jobs plan --scale`: what a corpus the size the anchors trained on costs, by data mode.

GPU-hours per stage, store bytes and wall time for each conversation count, priced from the recipe's
`plan` estimate of one run (plan.make_plan) at the recipe's stated throughputs.
"""

from __future__ import annotations

import json
import math

from eagle_jobs.hsformat import storage_for
from eagle_jobs.plan import duration_text, human_bytes, make_plan
from eagle_jobs.plan_time import SCALE_MODES, ScaleBasis, mode_cost, spans, time_basis
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import Plan

ANCHORS = ("AQ-MedAI Kimi-K2-Instruct-eagle3: 1.4 M regenerated Open-PerfectBlend samples (MATH500 tau 3.47); "
           "lightseekorg kimi-k2.5-eagle3: about 600 k samples, 6 B tokens, about 1,500 H200-hours on 2 inference "
           "+ 2 training nodes (their model cards on the Hugging Face hub)")


def scale_basis(recipe: Recipe, plan: Plan) -> ScaleBasis:
    """What one conversation of the recipe's `plan` costs: the basis every row is priced from."""
    bpt = {d: n // max(1, plan["tokens"]) for d, n in plan["hidden_state_bytes"].items()}
    return time_basis(recipe, plan["samples"] / plan["conversations"], plan["tokens_per_sample"], bpt)


def parse_scales(text: str) -> list[int]:
    """`10000,100000,1000000` or `10k,100k,1M`: conversation counts, each at least 1."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        mult = {"k": 1_000, "m": 1_000_000}.get(item[-1].lower(), 1)
        digits = item[:-1] if mult > 1 else item
        if not digits.isdigit() or int(digits) * mult < 1:
            raise ValueError(f"{item!r} is not a conversation count (use e.g. 10000,100000,1000000 or 10k,100k,1M)")
        out.append(int(digits) * mult)
    if not out:
        raise ValueError("no conversation counts (use e.g. 10000,100000,1000000)")
    return out


def _gpu_h(seconds: float, gpus: int) -> float:
    return seconds * gpus / 3600


def price_mode(b: ScaleBasis, conversations: int, mode: str) -> dict:
    """One row: GPU-hours per stage (booked, and extraction's busy share), store bytes and wall time."""
    samples = conversations * b.samples_per_conversation
    tokens = int(samples * b.tokens_per_sample)
    storage = storage_for(b.storage, tokens * b.bytes_per_token["bfloat16"], b.fp8_above_bytes)
    corpus = tokens * b.bytes_per_token[storage]
    s = spans(b, samples, tokens, corpus)
    c, r = mode_cost(b, s, corpus, mode), b.rates
    extract_gpus = r.gpus_per_node * r.extract_nodes
    gpu_h = {"capture": _gpu_h(s.capture, r.gpus_per_node * r.capture_nodes),
             "extract": _gpu_h(c.extract_span, extract_gpus), "train": _gpu_h(c.train_span, b.train_gpus)}
    # stored runs the stages one after another; streaming overlaps extraction and training
    wall = s.capture + (c.extract_span if mode == "stored" else 0) + c.train_span
    return {"conversations": conversations, "mode": mode, "samples": samples, "tokens": tokens,
            "storage": storage, "corpus_bytes": corpus, "gpu_hours": gpu_h, "total_gpu_hours": sum(gpu_h.values()),
            "extract_busy_gpu_hours": _gpu_h(c.passes * s.extract, extract_gpus), "extract_passes": c.passes,
            "peak_store_bytes": c.peak, "written_bytes": c.written, "read_bytes": c.reads,
            "traffic_bytes": c.written + c.reads, "wall_s": wall,
            "train_read_bound": s.first_epoch > s.compute,
            # fewest extraction pods that keep one pass within one training epoch (what streaming needs)
            "extract_nodes_to_keep_pace": math.ceil(s.extract * r.extract_nodes / s.first_epoch)}


def scale_sources(recipe: Recipe, b: ScaleBasis) -> dict[str, dict]:
    """Every number the table rests on, with where it comes from: the recipe, or a default and its source."""
    out = {}
    for name, field in type(recipe.plan).model_fields.items():
        given = name in recipe.plan.model_fields_set
        out[f"plan.{name}"] = {"value": getattr(recipe.plan, name),
                               "from": f"recipe {recipe.name}" if given else f"default: {field.description}"}
    window_given = recipe.store.window_bytes
    out["window_bytes"] = {"value": b.window_bytes, "from": "recipe store.window_bytes" if window_given
                           else "plan.stream_window_bytes (the recipe has no store.window_bytes)"}
    for dtype, n in b.bytes_per_token.items():
        out[f"bytes_per_token.{dtype}"] = {"value": n, "from": "hsformat.bytes_per_token: (aux layers + 1) x "
                                           f"hidden size x {dtype} (+ fp8's scales) + token id/mask"}
    out["fp8_above_bytes"] = {"value": b.fp8_above_bytes, "from": f"recipe extract section (storage_dtype {b.storage}: "
                              + ("fp8 above it, bfloat16 below)" if b.storage == "auto" else "not used)")}
    out["tokens_per_sample"] = {"value": b.tokens_per_sample, "from": "the prompt set's mean prompt (or limits) + "
                                "sampling.max_new_tokens, capped at limits.max_seq_len (an upper bound)"}
    for key, val in (("epochs", b.epochs), ("train_nodes", b.train_nodes), ("train_gpus", b.train_gpus),
                     ("shard_bytes", b.shard_bytes), ("local_stage_bytes", b.local_stage_bytes)):
        out[key] = {"value": val, "from": "recipe train/extract section"}
    return out


def _scale_title(recipe: Recipe, b: ScaleBasis, conversations: list[int]) -> str:
    r = b.rates
    return (f"plan {recipe.name} at {' / '.join(f'{n:,}' for n in conversations)} conversations: "
            f"{b.samples_per_conversation:g} sample(s) per conversation of <= {b.tokens_per_sample:,.0f} tokens, "
            f"hidden states of {_storage_words(b)}, {b.epochs} epochs; "
            f"capture on {r.capture_nodes}, extraction on {r.extract_nodes} and training on {b.train_nodes} "
            f"node(s) of {r.gpus_per_node} GPUs")


def _storage_words(b: ScaleBasis) -> str:
    bpt = b.bytes_per_token
    if b.storage != "auto":
        return f"{bpt[b.storage]:,} bytes of {b.storage} a token"
    return (f"{bpt['bfloat16']:,} bytes a token in bfloat16, {bpt['fp8']:,} in fp8 (storage auto: fp8 once a corpus "
            f"is above {human_bytes(b.fp8_above_bytes)} in bfloat16)")


def scale_table(recipe: Recipe, conversations: list[int]) -> dict:
    """The JSON form of `plan --scale`: one row per (conversations, mode), and the sources."""
    b = scale_basis(recipe, make_plan(recipe))
    rows = [price_mode(b, n, m) for n in conversations for m in SCALE_MODES]
    return {"recipe": recipe.name, "title": _scale_title(recipe, b, conversations), "modes": SCALE_MODES, "rows": rows,
            "sources": scale_sources(recipe, b), "anchors": ANCHORS}


def _wall(s: float) -> str:
    return f"{s / 86400:,.1f} d" if s >= 2 * 86400 else duration_text(s)


def _gpu_cell(h: float) -> str:
    return f"{h:,.0f}" if h >= 10 else f"{h:,.1f}"


def _extract_cell(booked: float, busy: float) -> str:
    return _gpu_cell(booked) if _gpu_cell(booked) == _gpu_cell(busy) else f"{_gpu_cell(booked)} ({_gpu_cell(busy)})"


def _pace_note(table: dict) -> list[str]:
    r = next((r for r in table["rows"] if r["mode"] == "re-extract"), None)
    need, have = (r["extract_nodes_to_keep_pace"], table["sources"]["plan.extract_nodes"]["value"]) if r else (0, 0)
    if not r or need >= have:
        return []
    return ["", f"In re-extract, {need} of the {have} extraction pods keep pace with training (a pass within an "
            "epoch); the others wait on the window while booked: set `plan.extract_nodes` (and the overlay's "
            "extraction completions) to price fewer."]


def _read_bound_note(table: dict) -> list[str]:
    bound = [r for r in table["rows"] if r["train_read_bound"]]
    if not bound:
        return ["Training is compute-bound at these rates in every row."]
    r = bound[0]
    return [f"Training is bound by store reads, not compute, in {len(bound)} of {len(table['rows'])} rows: an "
            f"epoch of {r['conversations']:,} conversations reads {human_bytes(r['corpus_bytes'])} at "
            f"`plan.store_bytes_per_s` per training pod, longer than its compute at "
            "`plan.train_samples_per_s_per_gpu`."]


def scale_markdown(table: dict) -> str:
    """The table `plan --scale` prints and docs/OPERATIONS.md carries (tests keep them equal)."""
    lines = [table["title"], "",
             "| conversations | mode | states | capture GPU-h | extract GPU-h (busy) | train GPU-h | total GPU-h "
             "| peak store | written | traffic | wall |", "|" + "---|" * 11]
    for row in table["rows"]:
        g = row["gpu_hours"]
        lines.append(f"| {row['conversations']:,} | {row['mode']} | {row['storage']} | {_gpu_cell(g['capture'])} | "
                     f"{_extract_cell(g['extract'], row['extract_busy_gpu_hours'])} | "
                     f"{_gpu_cell(g['train'])} | {_gpu_cell(row['total_gpu_hours'])} | "
                     f"{human_bytes(row['peak_store_bytes'])} | {human_bytes(row['written_bytes'])} | "
                     f"{human_bytes(row['traffic_bytes'])} | {_wall(row['wall_s'])} |")
    lines += ["", "GPU-hours are booked hours (pods held, busy or waiting); extraction's busy share is in "
              "brackets where it differs. Store columns count hidden states only; "
              "traffic is what is written plus what is read. "
              "Wall time is capture, extraction and training: no evaluation, node waits or model loads."]
    lines += [""] + _read_bound_note(table) + _pace_note(table)
    lines += ["", "Modes:"] + [f"- {m}: {what}" for m, what in table["modes"].items()]
    lines += ["", "Where the numbers come from:"]
    lines += [f"- `{k}` = {v['value']:,}: {v['from']}" for k, v in table["sources"].items()]
    return "\n".join(lines + ["", f"Anchors: {table['anchors']}"]) + "\n"


def print_scale(recipe: Recipe, conversations: list[int], as_json: bool = False) -> dict:
    """`plan --scale`: the markdown table docs/OPERATIONS.md carries, or its JSON form."""
    table = scale_table(recipe, conversations)
    print(json.dumps(table, indent=1) if as_json else scale_markdown(table), end="\n" if as_json else "")
    return table
