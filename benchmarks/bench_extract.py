"""Extraction overhead: `eagle-jobs extract` (transformers backend) vs the bare forward pass.

Same model (the demo's SmolLM2-135M-Instruct), same rows, same batching, same run.
Target: extraction keeps >= 90% of the bare forward's tokens/s, i.e. packing
(bf16 + safetensors) and committing to the store hide behind compute. Also
prints bytes stored per token against layers x hidden x 2.

    .venv/bin/python benchmarks/bench_extract.py [--rows 160] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import demo_recipe, write_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from eagle_jobs.committed import read_rows
    from eagle_jobs.extract import batches_by_tokens, forward_batch, run_extract
    from eagle_jobs.store import Stage, Store
    from eagle_jobs.verifier import load_verifier

    recipe = demo_recipe(extract={"shard_bytes": 32 * 1024**2})
    v = load_verifier(recipe.verifier)
    tmp = tempfile.mkdtemp()
    src = Store.open(f"file://{tmp}/src")
    write_rows(src, "b", args.rows, v.config.vocab_size)
    rows = read_rows(src, "b")
    tokens = sum(len(r["input_ids"]) for r in rows)
    batches = batches_by_tokens(rows, recipe.extract.batch_tokens)
    forward_batch(v.model, batches[0], None)  # warm-up

    bare, full = [], []
    for rep in range(args.repeats):
        t = time.perf_counter()
        for b in batches:
            forward_batch(v.model, b, None)
        bare.append(tokens / (time.perf_counter() - t))

        st = Store.open(f"file://{tmp}/out{rep}")
        st.put("b/capture/COMPLETE.json", src.get("b/capture/COMPLETE.json"))
        for k in src.list("b/capture/manifests") + src.list("b/capture/data"):
            st.put(k, src.get(k))
        t = time.perf_counter()
        run_extract(recipe, st, "b", 0, 1)
        full.append(tokens / (time.perf_counter() - t))

    ratio = max(full) / max(bare)
    ms = Stage(st, "b", "extract").manifests()
    size = sum(next(iter(m["files"].values()))["size"] for m in ms)
    stored_tokens = sum(e["num_tokens"] for m in ms for e in m["samples"])
    L, H = len(recipe.aux_layer_ids) + 1, v.config.hidden_size
    ideal = stored_tokens * L * H * 2
    print(f"rows {len(rows)}, tokens {tokens}, batches {len(batches)}, shards {len(ms)}")
    print(f"bare forward:  {max(bare):,.0f} tok/s  (runs: {', '.join(f'{x:,.0f}' for x in bare)})")
    print(f"extract stage: {max(full):,.0f} tok/s  (runs: {', '.join(f'{x:,.0f}' for x in full)})")
    print(f"extract / bare = {ratio:.3f}  (target >= 0.90)")
    print(f"bytes per token: {size / stored_tokens:,.1f} vs L*H*2 = {L * H * 2:,}  "
          f"(overhead {100 * (size - ideal) / ideal:.2f}%, target < 1%)")


if __name__ == "__main__":
    main()
