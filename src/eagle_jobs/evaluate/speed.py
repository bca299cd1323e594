"""The speed pass: output tokens per second of timed streamed passes at each concurrency level, on a
server with the draft and on one without it, and their ratio per draft length and level."""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from eagle_jobs.errors import Unavailable
from eagle_jobs.evaluate.engine import chat_body, drafts_and_accepted, served_model, spec_counters
from eagle_jobs.progress import console
from eagle_jobs.recipe import LONG_OUTPUT_SET, Recipe
from eagle_jobs.records import SpeedLevel, SpeedTable, TimedPass
from eagle_jobs.serve_plans import evaluate_plan
from eagle_jobs.settings import settings


def timed_sets(sets: dict[str, list[list[dict]]]) -> dict[str, list[list[dict]]]:
    """The sets the speed pass times: all but the long-output set, whose answers are for τ by position."""
    return {name: m for name, m in sets.items() if name != LONG_OUTPUT_SET}


WARM_UP = [{"role": "user", "content": "Count from one to twenty in words, one number per line."}]


def stream_chat(client, base: str, body: dict) -> tuple[int, float]:
    """One streamed chat request: (output tokens, seconds to its first chunk).

    vLLM sends a request's first chunk (its role) when the engine returns the request's first output,
    i.e. after prefill and the first token (OpenAIServingChat.chat_completion_stream_generator,
    `first_iteration`, vllm/entrypoints/openai/chat_completion/serving.py); the token count is the
    usage chunk that stream_options.include_usage adds at the end."""
    start, ttft, tokens = time.perf_counter(), None, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise Unavailable(f"{base}/v1/chat/completions: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise Unavailable(f"{base}/v1/chat/completions: {chunk['error']}")
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens is None or ttft is None:
        raise Unavailable(f"{base}/v1/chat/completions: the stream ended without a token or its usage")
    return tokens, ttft


def timed_pass(recipe: Recipe, base: str, bodies: list[dict], concurrency: int) -> TimedPass:
    """`concurrency` requests in flight until every body is answered (each worker sends its next request
    as its last one ends). Output tokens per second over the pass's wall time, and each request's TTFT."""
    import httpx

    timeout = httpx.Timeout(recipe.evaluate.vllm.request_timeout_s, connect=30)
    with httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=concurrency)) as c, \
            ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda b: stream_chat(c, base, b), bodies))
        seconds = time.perf_counter() - start
    tokens, ttft = sum(a[0] for a in answers), sorted(a[1] for a in answers)
    return TimedPass(requests=len(bodies), output_tokens=tokens, seconds=seconds,
                     output_tokens_per_s=tokens / seconds, ttft_s_mean=sum(ttft) / len(ttft),
                     ttft_s_p50=statistics.median(ttft), ttft_s_max=ttft[-1], acceptance_length=None)


def measure_speed(recipe: Recipe, base: str, model: str, sets: dict[str, list[list[dict]]],
                  label: str, drafted: bool = False) -> dict[str, dict[int, TimedPass]]:
    """Every set at every evaluate.concurrency_levels, after a warm-up that is not counted. Each level
    takes the set's next prompts (distinct while the set lasts), so no level finds its prompts cached.
    drafted: each pass's τ too, from the /metrics counters around it."""
    ev = recipe.evaluate
    top = max(ev.concurrency_levels)
    timed_pass(recipe, base, [chat_body(recipe, model, WARM_UP)] * top, top)  # one-off first-request costs
    out: dict[str, dict[int, TimedPass]] = {}
    for name, prompts in sets.items():
        offset, out[name] = 0, {}
        for level in ev.concurrency_levels:
            n = ev.speedup_requests_at(level)
            bodies = [chat_body(recipe, model, prompts[(offset + i) % len(prompts)]) for i in range(n)]
            offset += n
            before = spec_counters(base) if drafted else None
            t = out[name][level] = timed_pass(recipe, base, bodies, level)
            if before is not None:
                drafts, accepted = drafts_and_accepted(before, spec_counters(base))
                t["acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
            console.print(f"  speed {label}: {name}, concurrency {level}: {n} requests, {t['output_tokens']} tokens "
                          f"in {t['seconds']:.1f} s = {t['output_tokens_per_s']:.1f} tokens/s, "
                          f"TTFT {t['ttft_s_mean']:.2f} s", soft_wrap=True, markup=False, highlight=False)
    return out


def speed_without_draft(recipe: Recipe, sets: dict[str, list[list[dict]]]) -> dict[str, dict[int, TimedPass]]:
    """The same timed passes on a server with the same serve_args and no --speculative-config. A second
    process: vLLM 0.32 fixes speculative decoding per engine (VllmConfig.speculative_config, built once
    from --speculative-config) and has no request field or batch-size rule that turns it off."""
    from eagle_jobs.vllm_server import vllm_endpoint

    with vllm_endpoint(evaluate_plan(recipe, None)) as base:
        return measure_speed(recipe, base, served_model(base), sets, "without a draft")


def speedup_table(by_k: dict[int, dict[int, TimedPass]], without: dict[int, TimedPass] | None,
                  recipe: Recipe) -> SpeedTable | None:
    """One set's speed per draft length and concurrency level: with and without the draft, and their ratio."""
    if not by_k or not without:
        return None
    surface = [SpeedLevel(k=k, concurrency=lv, requests=w["requests"], with_draft=w, without_draft=without[lv],
                          speedup=w["output_tokens_per_s"] / without[lv]["output_tokens_per_s"])
               for k in sorted(by_k) for lv, w in by_k[k].items()]
    return SpeedTable(max_tokens=recipe.evaluate.max_new_tokens,
                      levels=[c for c in surface if c["k"] == recipe.evaluate.k], surface=surface)


SPEED_NOTE = ("output tokens per second of streamed greedy chat requests with the draft over without it, each "
              "concurrency level a closed loop of that many requests in flight, after an uncounted warm-up; the "
              "server without the draft is started with the same serve_args and no --speculative-config")


def own_servers(recipe: Recipe) -> bool:
    """Whether evaluate starts its vLLM servers itself: no endpoint in the recipe, no pod sidecar
    ($EAGLE_JOBS_VLLM_ENDPOINT, components/vllm-sidecar)."""
    return not (recipe.evaluate.vllm.endpoint or settings().vllm_endpoint)


def sidecar_switches(recipe: Recipe) -> bool:
    """Whether the pod's vLLM sidecar serves each of evaluate's servers in turn, on the worker's request:
    prepare wrote them all ($EAGLE_JOBS_VLLM_PLANS, eagle_jobs.vllm_switch)."""
    from eagle_jobs.vllm_switch import PreparedPlans

    s = settings()
    if recipe.evaluate.vllm.endpoint or not s.vllm_endpoint or s.vllm_plans is None or not s.vllm_plans.is_file():
        return False
    return len(PreparedPlans.read(s.vllm_plans).plans) > 1


NOT_TIMED = ("not measured: evaluate talks to one given server (evaluate.vllm.endpoint), and the untrained draft, "
             "each other k and the server without a draft need servers of their own")

