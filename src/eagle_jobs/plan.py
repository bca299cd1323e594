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
from pathlib import Path

from rich.table import Table

from eagle_jobs.draft import DraftShape, resolve_shape
from eagle_jobs.hsformat import bytes_per_token, resolve_storage
from eagle_jobs.layout import StageName
from eagle_jobs.plan_time import mode_cost, recipe_mode, spans, time_basis
from eagle_jobs.progress import console
from eagle_jobs.recipe import DraftSpec, Recipe
from eagle_jobs.records import Plan, StagePlan


def human_bytes(n: float, unit: str = "B") -> str:
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
    """How long the stage's worker waits for its vLLM servers to answer /health (0: no server). Evaluate
    loads the verifier once a server, whether it starts them or a pod's sidecar switches between them
    (eagle_jobs.vllm_switch): the trained draft at evaluate.k, the untrained draft, each other k of the
    speed pass and the server without a draft, as it prices their passes above."""
    if stage not in VLLM_STAGES:
        return 0.0
    spec = getattr(recipe, stage)
    if spec.backend != "vllm":
        return 0.0
    if stage != StageName.EVALUATE:
        return spec.vllm.health_timeout_s
    from eagle_jobs.serve_plans import evaluate_plans  # pure: names the servers, starts none

    servers = len(evaluate_plans(recipe, Path("draft"), Path("untrained-draft")))
    return servers * spec.vllm.health_timeout_s


# One SIGTERM checkpoint save (docs/OPERATIONS.md#preemption), at speeds measured on a 2-vCPU VM with a
# virtual disk, so on the slow side: speculators' local write (safetensors + torch.save, then sync) at
# 205 MiB/s, export_checkpoint_dir (the optimizer state re-read into safetensors) at 345 MiB/s, then the
# upload at the recipe's plan.store_bytes_per_s.
SAVE_WRITE_BPS, SAVE_EXPORT_BPS = 205 * 2**20, 345 * 2**20


def checkpoint_save_s(nbytes: float, store_bytes_per_s: float) -> float:
    return nbytes / SAVE_WRITE_BPS + nbytes / SAVE_EXPORT_BPS + nbytes / store_bytes_per_s


def untrained_draft_bytes(shape, params: dict) -> int:
    """Peak memory of building evaluate's untrained draft (evaluate.decode.save_untrained), an upper bound:
    the draft's every parameter in bf16, and the verifier's embeddings and head as speculators loads them
    (bf16) to copy from. benchmarks/bench_untrained_draft.py measures the build."""
    return 2 * params["total"] + 2 * 2 * shape.verifier_vocab_size * shape.hidden_size


def make_plan(recipe: Recipe) -> Plan:
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
    val = recipe.prompts.validation
    n_val = int(val) if val >= 1 else int(round(convs * val))
    ev = recipe.evaluate
    eval_tokens = 2 * min(ev.num_prompts or n_val, n_val) * ev.max_new_tokens  # trained and untrained draft
    if ev.long_output is not None:  # the trained draft only
        eval_tokens += ev.long_output.num_prompts * ev.long_output.max_new_tokens
    if ev.backend == "vllm":  # the speed passes, with the draft at each k and without (an upper bound on each)
        timed = sum(ev.speedup_requests_at(c) for c in ev.concurrency_levels)
        eval_tokens += (len(ev.num_speculative_tokens) + 1) * timed * ev.max_new_tokens
    # the one time model (plan_time): stored, streamed, or streamed again each epoch (re-extract)
    basis = time_basis(recipe, gens / convs, seq,
                       {d: bytes_per_token(n_layers, shape.hidden_size, d) for d in ("bfloat16", "fp8")})
    span = spans(basis, gens, tokens, hs)
    mode = mode_cost(basis, span, hs, recipe_mode(recipe))
    passes = mode.passes
    # (time_s, objects, write_bytes, read_bytes) of each stage
    costs = {
        "capture": (span.capture, 2 * capture_shards + 2, tokens * 8, 0),
        "extract": (mode.extract_span, 2 * passes * extract_shards + 2, mode.written, passes * tokens * 8),
        "train": (mode.train_span, 2 * (t.epochs + 1) + 1, ckpt * t.epochs, mode.reads),
        "evaluate": (eval_tokens / tp.eval_tokens_per_s, 8 if ev.backend == "vllm" else 7, 1e6, params["total"] * 2),
    }
    stages: dict[str, StagePlan] = {
        name: {"time_s": time_s, "objects": objects, "write_bytes": write, "read_bytes": read,
               "deadline_floor_s": deadline_floor_s(time_s, server_load_s(recipe, name))}
        for name, (time_s, objects, write, read) in costs.items()}
    return {"conversations": convs, "samples": gens, "tokens": tokens, "tokens_per_sample": seq,
            "hidden_state_bytes": {"bfloat16": hs_bf16, "fp8": hs_fp8}, "stored_layers": n_layers, "storage": storage,
            "draft_shape": shape.describe(), "draft_parameters": params, "gpus_for_training": gpus,
            "train_checkpoint": {"bytes": ckpt, "save_s": checkpoint_save_s(ckpt, tp.store_bytes_per_s)},
            "untrained_draft_bytes": untrained_draft_bytes(shape, params),
            "stages": stages, "total_time_s": sum(s["time_s"] for s in stages.values()),
            "total_objects": sum(s["objects"] for s in stages.values())}


def _why_storage(recipe: Recipe) -> str:
    x = recipe.extract
    if x.storage_dtype != "auto":
        return ""
    return f" (extract.storage_dtype auto: fp8 above {human_bytes(x.fp8_above_bytes)} in bf16)"


def print_plan(recipe: Recipe, store=None, run_id: str | None = None, as_json: bool = False) -> Plan:
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
    console.print(f"  hidden states: {human_bytes(p['hidden_state_bytes']['bfloat16'])} bf16, "
                  f"{human_bytes(p['hidden_state_bytes']['fp8'])} fp8 ({p['stored_layers']} layers), stored as "
                  f"{p['storage']}{_why_storage(recipe)}; "
                  f"draft {p['draft_parameters']['trainable']:,} trainable / "
                  f"{p['draft_parameters']['total']:,} total parameters")
    ck = p["train_checkpoint"]
    console.print(f"  a train checkpoint: {human_bytes(ck['bytes'])}, about {ck['save_s']:.0f} s to save on SIGTERM "
                  f"(within torchrun's shutdown timeout and the pod's terminationGracePeriodSeconds)")
    t = Table(title="per stage (stated throughputs: recipe `plan:`)")
    for c in ("stage", "time", "objects", "store writes", "store reads", "deadline >="):
        t.add_column(c)
    for name, s in p["stages"].items():
        t.add_row(name, duration_text(s["time_s"]), f"{s['objects']:,}", human_bytes(s["write_bytes"]),
                  human_bytes(s["read_bytes"]), f"{s['deadline_floor_s']:,} s")
    t.add_row("total", duration_text(p["total_time_s"]), f"{p['total_objects']:,}", "", "")
    console.print(t)
    return p
