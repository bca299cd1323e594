"""Training fed from the S3 store vs from the same shards on local disk.

The demo draft on synthetic demo-shaped rows: the same committed extraction is
put in a file:// store and in a real S3 API (moto's server on 127.0.0.1), then
`run_train --max-steps N` runs from each, in the same process. Reported: the
median step time (speculators' own per-step profile, after warm-up) for
  local    file:// store (shards read in place by range reads)
  s3       S3 store, shards staged ahead to bounded local disk (the default)
  s3-range S3 store, no staging: one ranged GET per sample
Target: s3 / local <= 1.1.

    .venv/bin/python benchmarks/bench_train_store.py [--rows 120] [--steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import demo_recipe, moto_s3, write_rows


def copy_run(src, dst, run_id: str) -> None:
    for stage in ("capture", "extract"):
        for sub in ("data", "manifests", "workers"):
            for k in src.list(f"{run_id}/{stage}/{sub}"):
                dst.put(k, src.get(k))
        dst.put(f"{run_id}/{stage}/COMPLETE.json", src.get(f"{run_id}/{stage}/COMPLETE.json"))


def step_ms(rec: dict, skip: int) -> float:
    ms = [m["profile"]["step_ms"] for m in rec["metrics"] if m.get("profile")]
    return statistics.median(ms[skip:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()

    from eagle_jobs.extract import run_extract
    from eagle_jobs.store import Store
    from eagle_jobs.train.run import run_train
    from eagle_jobs.verifier import load_verifier

    recipe = demo_recipe(extract={"shard_bytes": 16 * 1024**2}, train={"epochs": 1})
    v = load_verifier(recipe.verifier)
    tmp = Path(tempfile.mkdtemp())
    local = Store.open(f"file://{tmp}/local")
    write_rows(local, "b", args.rows, v.config.vocab_size)
    run_extract(recipe, local, "b", 0, 1)
    with moto_s3() as uri:
        s3 = Store.open(uri)
        copy_run(local, s3, "b")
        results = {}
        for name, store, budget in (("local", local, None), ("s3", s3, None), ("s3-range", s3, 0),
                                    ("local-again", local, None)):
            r = recipe if budget is None else demo_recipe(train={"epochs": 1, "local_stage_bytes": 1})
            for k in store.list("b/train/manifests") + store.list("b/train/data"):
                store.delete(k)
            store.delete("b/train")
            rec = run_train(r, store, "b", max_steps=args.steps, work_dir=tmp / f"w-{name}")
            results[name] = step_ms(rec, skip=3)
    base = min(results["local"], results["local-again"])
    for name, ms in results.items():
        print(f"{name:12s} median step {ms:8.1f} ms   ratio to local {ms / base:.3f}")
    print(f"s3 (staged) / local = {results['s3'] / base:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
