"""A vLLM server as evaluate talks to it (a request's body, the served model, the spec_decode counters
of /metrics), and the record of the engine a τ was measured on (a server, or this process's loop)."""

from __future__ import annotations

import re
from typing import cast

import torch

from eagle_jobs.layout import content_hash
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import EngineRecord

# What vLLM does with an EAGLE-3 draft that our --speculative-config leaves to its defaults (vllm 0.32
# config/speculative.py:529 rejection_sample_method, :600 draft_sample_method): in effect in every τ.
VLLM_SPEC_DEFAULTS = {"rejection_sample_method": "standard", "draft_sample_method": "greedy"}
# What the server's log says it chose (vllm 0.32 v1/worker/gpu_worker.py:518 and cpu_worker.py:162 log
# the V2 runner; platforms/cuda.py:446,507 and cpu.py:163,175 the attention backend, CPU_ATTN unlogged).
_V2_RUNNER = "Using V2 Model Runner"
_ATTENTION = re.compile(r"Using (\w+) (?:attention )?backend")


NOT_SEEN = "not seen: an external server (its own log says)"


def engine_record(recipe: Recipe, base: str | None = None, log_text: str | None = None,
                  attention: str | None = None) -> EngineRecord:
    """The engine a τ was measured on: base, a vLLM server (its /version; runner and attention backend
    from log_text, its log, where this process started it); None, this process's transformers loop."""
    ev = recipe.evaluate
    sampling = {"temperature": 0.0, "max_tokens": ev.max_new_tokens,
                "chat_template_kwargs": recipe.chat.template_kwargs()}
    if base is None:
        import transformers

        rec = {"engine": "transformers",
               "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
               "model_runner": "eagle-jobs greedy chain loop (evaluate.speculative_generate)",
               "attention_backend": attention or "sdpa", "spec_method": "eagle3",
               "spec_settings": {"num_speculative_tokens": ev.k,
                                 "acceptance": "a draft token counts while it equals the verifier's argmax"},
               "sampling": sampling}
    else:
        import httpx

        version = httpx.get(f"{base}/version", timeout=30).json()["version"]  # serve/instrumentator/basic.py:53
        found = _ATTENTION.search(log_text or "")
        rec = {"engine": "vllm", "version": str(version),
               "model_runner": NOT_SEEN if log_text is None else "V2" if _V2_RUNNER in log_text else "V1",
               "attention_backend": (NOT_SEEN if log_text is None
                                     else found.group(1) if found else "the platform's default (not logged)"),
               "spec_method": "eagle3",
               "spec_settings": {"num_speculative_tokens": ev.k, **VLLM_SPEC_DEFAULTS},
               "sampling": sampling}
    return cast(EngineRecord, {**rec, "key": content_hash(rec, 16)})


def describe_engine(e: EngineRecord | dict | None) -> str:
    if not e:
        return "an engine it does not name (its record has no `engine`)"
    return (f"{e['engine']} {e['version']}, runner {e['model_runner']}, attention {e['attention_backend']}, "
            f"{e['spec_method']} {e['spec_settings']}")


_METRIC = re.compile(r'^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')


def parse_spec_metrics(text: str) -> dict:
    """The vllm:spec_decode_* counters (vllm/v1/spec_decode/metrics.py) from a /metrics page."""
    out: dict = {"per_pos": {}}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos_label = re.search(r'position="(\d+)"', labels)
            assert pos_label is not None, f"vLLM labels each per-position count with its position: {line}"
            pos = int(pos_label.group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + val
        else:
            out[name.removeprefix("vllm:spec_decode_")] = out.get(name.removeprefix("vllm:spec_decode_"), 0.0) + val
    return out


def chat_body(recipe: Recipe, model: str, msgs: list[dict], max_tokens: int | None = None) -> dict:
    """One evaluation request: greedy, the recipe's chat template arguments, max_tokens (default
    evaluate.max_new_tokens)."""
    kw = recipe.chat.template_kwargs()
    return {"model": model, "messages": msgs, "max_tokens": max_tokens or recipe.evaluate.max_new_tokens,
            "temperature": 0.0, **({"chat_template_kwargs": kw} if kw else {})}


def served_model(base: str) -> str:
    import httpx

    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def spec_counters(base: str) -> dict:
    import httpx

    return parse_spec_metrics(httpx.get(f"{base}/metrics", timeout=30).text)


def drafts_and_accepted(before: dict, after: dict) -> tuple[float, float]:
    """Drafts and accepted draft tokens between two reads of the /metrics counters (server-wide)."""
    return (after.get("num_drafts", 0) - before.get("num_drafts", 0),
            after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0))
