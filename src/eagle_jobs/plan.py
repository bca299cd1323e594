"""`eagle-jobs plan`: the estimate before anyone books GPUs.

Tokens, hidden-state bytes (bf16 and fp8), object count, store traffic and time
per stage, from the recipe and stated throughputs (recipe `plan:` section).

The training default, 0.5 samples/s per GPU, is the seed's measured point
(10 samples x 3 epochs in about a minute on one RTX PRO 6000). The seed's own
extrapolation to "about 33 minutes for 1,000 samples x 10 epochs" is off by
10x: linear scaling of that point gives about 333 GPU-minutes (about 42 minutes
on 8 GPUs in data parallel), which is what this prints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from rich.table import Table

from eagle_jobs.draft import DraftShape, resolve_shape
from eagle_jobs.hsformat import bytes_per_token, resolve_storage, storage_for
from eagle_jobs.layout import StageName
from eagle_jobs.progress import console
from eagle_jobs.recipe import DraftSpec, Recipe, Throughputs


def _human(n: float, unit: str = "B") -> str:
    for p in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):  # binary multiples, so named as such (IEC)
        if abs(n) < 1024 or p == "Pi":
            return f"{n:,.1f} {p}{unit}" if p else f"{n:,.0f} {unit}"
        n /= 1024
    return f"{n} {unit}"


def duration_text(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def draft_parameters(s: DraftShape, num_aux: int, draft: DraftSpec) -> dict[str, int]:
    """speculators 0.9.0's Eagle3DraftModel, counted from the shape (tests compare it with a built draft)."""
    H, mlp = s.hidden_size, 3 * s.hidden_size * s.intermediate_size  # gate, up, down
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    qk_norms = 2 * s.head_dim if draft.architecture == "qwen3" else 0  # qwen3's per-head q_norm, k_norm
    # the first layer reads [embedding; fused states] (2H wide) and adds hidden_norm; the others are plain layers
    first = 2 * H * (q + 2 * kv) + q * H + mlp + 3 * H + qk_norms
    other = H * (q + 2 * kv) + q * H + mlp + 2 * H + qk_norms
    # fc (no bias), then input_norm over all aux states (norm_before_fc) or one norm per aux state (fc_norm)
    fc = num_aux * H * H + (num_aux * H if draft.norms.norm_before_fc or draft.norms.fc_norm else 0)
    trainable = fc + first + other * (s.num_layers - 1) + H  # + the output norm
    # embed_tokens, the draft lm_head, verifier_lm_head (its twin for the loss targets), verifier_norm
    frozen = s.verifier_vocab_size * H + 2 * s.draft_vocab_size * H + H
    total = trainable + frozen
    # checkpoints leave out the verifier's twins (Eagle3DraftModel._keys_to_ignore_on_save)
    return {"trainable": trainable, "total": total, "saved": total - s.draft_vocab_size * H - H}


def verifier_text_config(recipe: Recipe):
    """The verifier's text config if it can be read here; otherwise the recipe's own numbers."""
    from pathlib import Path
    from types import SimpleNamespace

    from eagle_jobs.errors import BadInput
    from eagle_jobs.verifier import load_config, text_config

    v, d = recipe.verifier, recipe.draft
    if v.model.startswith("pypi-gguf://") or Path(v.model).is_dir() or not (d.hidden_size and v.num_layers):
        return text_config(load_config(v))
    if d.hidden_size is None or v.num_layers is None:
        raise BadInput("plan: set verifier.num_layers and draft.hidden_size, or make the verifier config readable")
    return SimpleNamespace(num_hidden_layers=v.num_layers, hidden_size=d.hidden_size,
                               vocab_size=max(d.draft_vocab_size, 163840), num_attention_heads=d.num_attention_heads,
                               num_key_value_heads=d.num_key_value_heads, intermediate_size=d.intermediate_size)


def _prompt_stats(recipe: Recipe) -> tuple[int, int, float]:
    """(conversations, generations, mean prompt tokens) from the prompt set, or from the recipe's limit."""
    try:
        from eagle_jobs.prompts import load_prompt_index

        index = load_prompt_index(recipe.prompts)  # one streamed pass: a million conversations fit
        gens = index.generations
        return len(index.refs), gens, index.chars / max(1, gens) / 4 + 32  # ~4 characters a token, plus template
    except Exception:  # noqa: BLE001 - the prompt set is not reachable from here
        n = recipe.prompts.limit or 10000
        return n, n, min(512, recipe.limits.max_prompt_tokens)


# What a stage's activeDeadlineSeconds must cover beyond the estimate (docs/OPERATIONS.md#deadlines):
# a throughput DEADLINE_SLOWDOWN times below the stated one, a node and the image pull, and for a vLLM
# stage the time its worker waits for the server to load the verifier (the stage's vllm.health_timeout_s).
DEADLINE_SLOWDOWN, DEADLINE_WAIT_S = 4, 1800
VLLM_STAGES = (StageName.CAPTURE, StageName.EXTRACT, StageName.EVALUATE)


def deadline_floor_s(time_s: float, load_s: float) -> int:
    """The least activeDeadlineSeconds a stage of this estimate should have (a backstop, never a stall detector)."""
    return math.ceil(DEADLINE_SLOWDOWN * time_s + DEADLINE_WAIT_S + load_s)


def server_load_s(recipe: Recipe, stage: str) -> float:
    """How long the stage's worker waits for its vLLM servers to answer /health (0: no server). Evaluate,
    starting its own servers, loads the verifier once a server: the trained draft at evaluate.k, the
    untrained draft, each other k of the speed pass and the server without a draft, as it prices their
    passes above; a pod's sidecar loads it once, and the floor stays an upper bound there."""
    if stage not in VLLM_STAGES:
        return 0.0
    spec = getattr(recipe, stage)
    if spec.backend != "vllm":
        return 0.0
    servers = len(recipe.evaluate.num_speculative_tokens) + 2 if stage == StageName.EVALUATE else 1
    return servers * spec.vllm.health_timeout_s


# One SIGTERM checkpoint save (docs/OPERATIONS.md#preemption), at speeds measured on a 2-vCPU VM with a
# virtual disk, so on the slow side: speculators' local write (safetensors + torch.save, then sync) at
# 205 MiB/s, export_checkpoint_dir (the optimizer state re-read into safetensors) at 345 MiB/s, then the
# upload at the recipe's plan.store_bytes_per_s.
SAVE_WRITE_BPS, SAVE_EXPORT_BPS = 205 * 2**20, 345 * 2**20


def checkpoint_save_s(nbytes: float, store_bytes_per_s: float) -> float:
    return nbytes / SAVE_WRITE_BPS + nbytes / SAVE_EXPORT_BPS + nbytes / store_bytes_per_s


def make_plan(recipe: Recipe) -> dict:
    tcfg = verifier_text_config(recipe)
    shape = resolve_shape(recipe, tcfg)
    convs, gens, prompt_toks = _prompt_stats(recipe)
    gen_toks = recipe.sampling.max_new_tokens  # an upper bound: every answer runs to max_new_tokens
    seq = min(recipe.limits.max_seq_len, prompt_toks + gen_toks)
    tokens = int(gens * seq)
    n_layers = len(recipe.aux_layer_ids) + 1
    hs_bf16 = tokens * bytes_per_token(n_layers, shape.hidden_size, "bfloat16")
    hs_fp8 = tokens * bytes_per_token(n_layers, shape.hidden_size, "fp8")
    x = recipe.extract
    storage = resolve_storage(x.storage_dtype, tokens, n_layers, shape.hidden_size, x.fp8_above_bytes)
    hs = hs_fp8 if storage == "fp8" else hs_bf16
    t, tp = recipe.train, recipe.plan
    gpus = t.nproc_per_node * t.nnodes
    params = draft_parameters(shape, len(recipe.aux_layer_ids), recipe.draft)
    ckpt = params["saved"] * 2 + params["trainable"] * 2 * 2  # bf16 weights + bf16 Adam moments
    capture_shards = math.ceil(convs / recipe.capture.prompts_per_shard)
    extract_shards = max(1, math.ceil(hs / recipe.extract.shard_bytes))
    # a corpus within train.local_stage_bytes is read from the store once (the node cache), unless every
    # epoch is extracted again
    reextract = t.source == "stream" and t.later_epochs == "re-extract"
    staged_reads = hs if hs <= t.local_stage_bytes and not reextract else hs * t.epochs
    val = recipe.prompts.validation
    n_val = int(val) if val >= 1 else int(round(convs * val))
    ev = recipe.evaluate
    eval_tokens = 2 * min(ev.num_prompts or n_val, n_val) * ev.max_new_tokens  # trained and untrained draft
    if ev.long_output is not None:  # the trained draft only
        eval_tokens += ev.long_output.num_prompts * ev.long_output.max_new_tokens
    if ev.backend == "vllm":  # the speed passes, with the draft at each k and without (an upper bound on each)
        timed = sum(ev.speedup_requests_at(c) for c in ev.concurrency_levels)
        eval_tokens += (len(ev.num_speculative_tokens) + 1) * timed * ev.max_new_tokens
    # the pods of a stage work side by side: capture's and extraction's shards split over plan.*_nodes
    extract_s = (tokens / tp.extract_tokens_per_s + hs / tp.store_bytes_per_s) / tp.extract_nodes
    train_s, passes = gens * t.epochs / (tp.train_samples_per_s_per_gpu * gpus), 1
    if t.source == "stream":  # training starts beside extraction and cannot finish an epoch before its pass
        epoch_s = train_s / t.epochs
        if t.later_epochs == "re-extract":
            passes, train_s = t.epochs, t.epochs * max(extract_s, epoch_s)
        else:
            train_s = max(extract_s, epoch_s) + (t.epochs - 1) * epoch_s
    stages = {
        "capture": {"time_s": gens * gen_toks / (tp.capture_tokens_per_s * tp.capture_nodes),
                    "objects": 2 * capture_shards + 2, "write_bytes": tokens * 8, "read_bytes": 0},
        "extract": {"time_s": passes * extract_s, "objects": 2 * passes * extract_shards + 2,
                    "write_bytes": passes * hs, "read_bytes": passes * tokens * 8},
        "train": {"time_s": train_s,
                  "objects": 2 * (t.epochs + 1) + 1, "write_bytes": ckpt * t.epochs, "read_bytes": staged_reads},
        "evaluate": {"time_s": eval_tokens / tp.eval_tokens_per_s, "objects": 8 if ev.backend == "vllm" else 7,
                     "write_bytes": 1e6, "read_bytes": params["total"] * 2},
    }
    for name, st in stages.items():
        st["deadline_floor_s"] = deadline_floor_s(st["time_s"], server_load_s(recipe, name))
    return {"conversations": convs, "samples": gens, "tokens": tokens, "tokens_per_sample": seq,
            "hidden_state_bytes": {"bfloat16": hs_bf16, "fp8": hs_fp8}, "stored_layers": n_layers, "storage": storage,
            "draft_shape": shape.describe(), "draft_parameters": params, "gpus_for_training": gpus,
            "train_checkpoint": {"bytes": ckpt, "save_s": checkpoint_save_s(ckpt, tp.store_bytes_per_s)},
            "stages": stages, "total_time_s": sum(s["time_s"] for s in stages.values()),
            "total_objects": sum(s["objects"] for s in stages.values())}


def _why_storage(recipe: Recipe) -> str:
    x = recipe.extract
    if x.storage_dtype != "auto":
        return ""
    return f" (extract.storage_dtype auto: fp8 above {_human(x.fp8_above_bytes)} in bf16)"


def print_plan(recipe: Recipe, store=None, run_id: str | None = None, as_json: bool = False) -> dict:
    p = make_plan(recipe)
    if store is not None:
        from eagle_jobs.prompts import load_prompt_index
        from eagle_jobs.reuse import reuse_plan

        p["reuse"] = reuse_plan(store, recipe.with_storage(p["storage"]), run_id or recipe.store.run_id,
                                load_prompt_index(recipe.prompts).refs)
    if as_json:
        print(json.dumps(p, indent=1))
        return p
    if store is not None:
        u = p["reuse"]
        console.print(f"  reuse from {store.uri}: {u['capture_reused']:,} of {u['conversations']:,} conversations "
                      f"already captured (runs {', '.join(u['from_runs']) or '-'}), "
                      f"{u['hidden_state_tokens_reused']:,} tokens of hidden states already extracted")
    console.print(f"[bold]plan[/] {recipe.name}: {p['conversations']:,} conversations, {p['samples']:,} samples, "
                  f"~{p['tokens']:,} tokens (<= {p['tokens_per_sample']:.0f}/sample)")
    console.print(f"  hidden states: {_human(p['hidden_state_bytes']['bfloat16'])} bf16, "
                  f"{_human(p['hidden_state_bytes']['fp8'])} fp8 ({p['stored_layers']} layers), stored as "
                  f"{p['storage']}{_why_storage(recipe)}; "
                  f"draft {p['draft_parameters']['trainable']:,} trainable / "
                  f"{p['draft_parameters']['total']:,} total parameters")
    ck = p["train_checkpoint"]
    console.print(f"  a train checkpoint: {_human(ck['bytes'])}, about {ck['save_s']:.0f} s to save on SIGTERM "
                  f"(within torchrun's shutdown timeout and the pod's terminationGracePeriodSeconds)")
    t = Table(title="per stage (stated throughputs: recipe `plan:`)")
    for c in ("stage", "time", "objects", "store writes", "store reads", "deadline >="):
        t.add_column(c)
    for name, s in p["stages"].items():
        t.add_row(name, duration_text(s["time_s"]), f"{s['objects']:,}", _human(s["write_bytes"]),
                  _human(s["read_bytes"]), f"{s['deadline_floor_s']:,} s")
    t.add_row("total", duration_text(p["total_time_s"]), f"{p['total_objects']:,}", "", "")
    console.print(t)
    return p


# ---- anchor-scale runs (`plan --scale`): what a corpus the size the anchors trained on costs, by data mode ----

SCALE_MODES = {
    "stored": "today: extraction writes the whole corpus before training starts, training re-reads it every epoch",
    "streaming": "training reads shards as extraction commits them (the first epoch overlaps extraction); "
                 "the shards stay for later epochs",
    "re-extract": "streaming through a bounded window: every epoch extraction runs again (prefill only, no "
                  "generation) and training deletes the shards it has read",
}
ANCHORS = ("AQ-MedAI Kimi-K2-Instruct-eagle3: 1.4 M regenerated Open-PerfectBlend samples (MATH500 tau 3.47); "
           "lightseekorg kimi-k2.5-eagle3: about 600 k samples, 6 B tokens, about 1,500 H200-hours on 2 inference "
           "+ 2 training nodes (their model cards on the Hugging Face hub)")


@dataclass(frozen=True)
class ScaleBasis:
    """What one conversation costs under a recipe, and the rates and sizes it is priced at."""

    samples_per_conversation: float
    tokens_per_sample: float  # an upper bound: every answer runs to sampling.max_new_tokens
    answer_tokens_per_sample: int
    bytes_per_token: dict[str, int]  # by storage dtype
    storage: str  # extract.storage_dtype: auto picks per corpus (hsformat.resolve_storage)
    fp8_above_bytes: int
    epochs: int
    train_nodes: int
    train_gpus: int
    local_stage_bytes: int
    shard_bytes: int
    window_bytes: int
    rates: Throughputs


@dataclass(frozen=True)
class Spans:
    """Wall seconds of capture, of one extraction pass, of training's compute per epoch and of its first and
    each later epoch (compute or store reads, whichever is slower), and the lead before streaming training
    can start (one shard per extraction pod committed)."""

    capture: float
    extract: float
    compute: float
    first_epoch: float
    later_epoch: float
    lead: float


@dataclass(frozen=True)
class ModeCost:
    """Seconds the extraction and training pods are booked, extraction passes, and hidden-state bytes."""

    extract_span: float
    train_span: float
    passes: int
    peak: int
    written: int
    reads: int


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


def scale_basis(recipe: Recipe, plan: dict) -> ScaleBasis:
    t = recipe.train
    window = recipe.store.window_bytes or recipe.plan.stream_window_bytes
    return ScaleBasis(samples_per_conversation=plan["samples"] / plan["conversations"],
                      tokens_per_sample=plan["tokens_per_sample"],
                      answer_tokens_per_sample=recipe.sampling.max_new_tokens,
                      bytes_per_token={d: n // max(1, plan["tokens"]) for d, n in plan["hidden_state_bytes"].items()},
                      storage=recipe.extract.storage_dtype, fp8_above_bytes=recipe.extract.fp8_above_bytes,
                      epochs=t.epochs, train_nodes=t.nnodes, train_gpus=t.nproc_per_node * t.nnodes,
                      local_stage_bytes=t.local_stage_bytes, shard_bytes=recipe.extract.shard_bytes,
                      window_bytes=window, rates=recipe.plan)


def _later_reads(b: ScaleBasis, corpus: int) -> int:
    return corpus if corpus > b.local_stage_bytes else 0  # a corpus that fits is staged once, on local disk


def _spans(b: ScaleBasis, samples: float, tokens: int, corpus: int) -> Spans:
    r = b.rates
    extract = (tokens / r.extract_tokens_per_s + corpus / r.store_bytes_per_s) / r.extract_nodes  # prefill, writes
    compute = samples / (r.train_samples_per_s_per_gpu * b.train_gpus)
    read_rate = r.store_bytes_per_s * b.train_nodes
    return Spans(capture=samples * b.answer_tokens_per_sample / (r.capture_tokens_per_s * r.capture_nodes),
                 extract=extract, compute=compute, first_epoch=max(compute, corpus / read_rate),
                 later_epoch=max(compute, _later_reads(b, corpus) / read_rate),
                 lead=extract * min(1.0, b.shard_bytes * r.extract_nodes / max(1, corpus)))


def _mode_cost(b: ScaleBasis, s: Spans, corpus: int, mode: str) -> ModeCost:
    ep, later = b.epochs, (b.epochs - 1) * s.later_epoch
    reads = corpus + (ep - 1) * _later_reads(b, corpus)
    if mode == "stored":
        return ModeCost(s.extract, s.first_epoch + later, 1, corpus, corpus, reads)
    if mode == "streaming":  # the first epoch ends when both the extraction and its own reading have
        return ModeCost(s.extract, max(s.extract, s.lead + s.first_epoch) + later, 1, corpus, corpus, reads)
    if mode == "re-extract":  # every epoch is a streamed pass; extraction pods wait while the window is full
        span = ep * max(s.extract, s.lead + s.first_epoch)
        peak = min(corpus, b.window_bytes + b.rates.extract_nodes * b.shard_bytes)
        return ModeCost(span, span, ep, peak, ep * corpus, ep * corpus)
    raise ValueError(f"unknown data mode {mode!r} (one of {', '.join(SCALE_MODES)})")


def _gpu_h(seconds: float, gpus: int) -> float:
    return seconds * gpus / 3600


def price_mode(b: ScaleBasis, conversations: int, mode: str) -> dict:
    """One row: GPU-hours per stage (booked, and extraction's busy share), store bytes and wall time."""
    samples = conversations * b.samples_per_conversation
    tokens = int(samples * b.tokens_per_sample)
    storage = storage_for(b.storage, tokens * b.bytes_per_token["bfloat16"], b.fp8_above_bytes)
    corpus = tokens * b.bytes_per_token[storage]
    s = _spans(b, samples, tokens, corpus)
    c, r = _mode_cost(b, s, corpus, mode), b.rates
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
            f"is above {_human(b.fp8_above_bytes)} in bfloat16)")


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
            f"epoch of {r['conversations']:,} conversations reads {_human(r['corpus_bytes'])} at "
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
                     f"{_human(row['peak_store_bytes'])} | {_human(row['written_bytes'])} | "
                     f"{_human(row['traffic_bytes'])} | {_wall(row['wall_s'])} |")
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
