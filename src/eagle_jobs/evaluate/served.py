"""The vLLM backend: one server a draft (started here, or the recipe's endpoint, or the pod's sidecar on request),
each set's speed pass first when asked, then its τ from the /metrics counters around the set and its τ by
output position from each response's verify steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

from eagle_jobs.evaluate.decode import by_position, steps_of_request
from eagle_jobs.evaluate.engine import chat_body, drafts_and_accepted, engine_record, served_model, spec_counters
from eagle_jobs.evaluate.sets import SetMeasurement, SetTau, max_tokens_of, served_token_count, within_limits
from eagle_jobs.evaluate.speed import measure_speed, own_servers, timed_sets
from eagle_jobs.progress import stage_progress
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import EngineRecord, TimedPass
from eagle_jobs.serve_plans import evaluate_plan


def _log_since(log: Path, offset: int) -> str:
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def evaluate_vllm(recipe: Recipe, draft_dir: Path, prompts: list[list[dict]]) -> SetMeasurement:
    return evaluate_vllm_sets(recipe, draft_dir, {"prompts": prompts})["prompts"]


def request_steps(body: dict) -> list[tuple[int, int]] | None:
    """A chat response's verify steps (--per-request-spec-decode-metrics detailed), or None where the
    server does not give them. vLLM leaves per_step_accepted out when a request had no verify step."""
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if spec is None or ("per_step_accepted" not in spec and spec.get("num_spec_steps")):
        return None
    return steps_of_request(spec.get("per_step_accepted") or [])


def tau_pass(recipe: Recipe, base: str, model: str, name: str, prompts: list[list[dict]]) -> SetTau:
    """One set's τ on a draft's server: the /metrics counters read before and after it (server-wide:
    every request of the set ends before `after` is read), and its τ by output position."""
    import httpx

    k, max_tokens = recipe.evaluate.k, max_tokens_of(recipe, name)

    def complete(msgs, c):
        r = c.post(f"{base}/v1/chat/completions", json=chat_body(recipe, model, msgs, max_tokens))
        r.raise_for_status()
        body = r.json()
        return body["usage"]["completion_tokens"], request_steps(body)

    before, tokens = spec_counters(base), 0
    steps: list[tuple[int, int]] | None = []
    with httpx.Client(timeout=recipe.evaluate.vllm.request_timeout_s) as c, \
            ThreadPoolExecutor(recipe.evaluate.concurrency) as pool, \
            stage_progress(f"evaluate (vllm): {name}", len(prompts), "prompts") as advance:
        for fut in as_completed([pool.submit(complete, msgs, c) for msgs in prompts]):
            n, request = fut.result()
            tokens += n
            steps = None if steps is None or request is None else steps + request
            advance(1, n)
    after = spec_counters(base)
    drafts, accepted = drafts_and_accepted(before, after)
    per_pos = [(after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0)) / drafts if drafts else 0.0
               for i in range(k)]
    return {"acceptance_length": 1 + accepted / drafts if drafts else 1.0, "per_position_acceptance": per_pos,
            "rounds": int(drafts), "tokens_generated": tokens, "outputs": [],
            "by_position": None if steps is None else by_position(steps, recipe.evaluate.position_bucket_tokens)}


@contextmanager
def draft_server(recipe: Recipe, draft_dir: Path, k: int, untrained: bool, sets: dict[str, list[list[dict]]]
                 ) -> Iterator[tuple[str, str, EngineRecord, dict[str, list[list[dict]]], dict[str, int]]]:
    """One server, the draft at k (untrained: the τ baseline): (its URL, its model name, the engine record,
    the sets' prompts within its limits, the prompts skipped as too long per set)."""
    from eagle_jobs.vllm_server import server_log, vllm_endpoint

    log = server_log(None, f"port-{recipe.evaluate.vllm.port}")  # vllm_endpoint's own choice, appended to
    ended = log.stat().st_size if log.is_file() else 0  # a server started here writes after this
    with vllm_endpoint(evaluate_plan(recipe, draft_dir, k, untrained), log) as base:
        model = served_model(base)
        engine = engine_record(recipe, base, _log_since(log, ended) if own_servers(recipe) else None)
        kept, too_long = within_limits(recipe, sets, served_token_count(recipe, base, model))
        yield base, model, engine, kept, too_long


def evaluate_vllm_sets(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]],
                       timed: bool = False, untrained: bool = False) -> dict[str, SetMeasurement]:
    """One server for every set, the draft at evaluate.k (untrained: the τ baseline): each set's τ (tau_pass).
    timed: first time each set but the long-output one at each concurrency level (measure_speed), as
    out[set]["speed"]."""
    k = recipe.evaluate.k
    with draft_server(recipe, draft_dir, k, untrained, sets) as (base, model, engine, sets, too_long):
        # timed before the τ pass, so that neither this server nor the one without a draft has seen the
        # timed prompts before (vLLM's prefix cache would shorten their prefill on one side only)
        started = time.perf_counter()
        speed = measure_speed(recipe, base, model, timed_sets(sets), f"with the draft at k={k}", True) if timed else {}
        speed_wall_s = time.perf_counter() - started
        return {name: {**tau_pass(recipe, base, model, name, prompts),
                       "speed": speed.get(name), "speed_wall_s": speed_wall_s, "prompts": prompts,
                       "skipped_too_long": too_long[name], "engine": engine}
                for name, prompts in sets.items()}


def speed_at(recipe: Recipe, draft_dir: Path, sets: dict[str, list[list[dict]]],
             k: int) -> dict[str, dict[int, TimedPass]]:
    """The timed passes alone, the draft at k (a speed-pass server: τ is measured at evaluate.k)."""
    with draft_server(recipe, draft_dir, k, False, sets) as (base, model, _engine, sets, _too_long):
        speed = measure_speed(recipe, base, model, timed_sets(sets), f"with the draft at k={k}", True)
        return {name: speed[name] for name in timed_sets(sets)}

