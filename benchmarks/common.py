"""Shared set-up for the benchmarks: the demo verifier, synthetic capture rows, a moto S3 server."""

from __future__ import annotations

import os
import random
import socket
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def demo_recipe(name: str = "demo-transformers", **over):
    from eagle_jobs.recipe_file import load_recipe

    r = load_recipe(REPO / f"jobs/{name}.yaml")
    for section, fields in over.items():
        r = r.model_copy(update={section: getattr(r, section).model_copy(update=fields)})
    return r


def write_rows(store, run_id: str, n: int, vocab: int, seed: int = 0, min_len: int = 120, max_len: int = 300) -> None:
    """Capture rows with demo-like lengths, committed like the capture stage does."""
    import json

    from eagle_jobs.store import Stage

    rnd = random.Random(seed)
    stage = Stage(store, run_id, "capture")
    rows = []
    for i in range(n):
        t = rnd.randint(min_len, max_len)
        p = rnd.randint(20, 60)
        rows.append({"row_id": f"{i:08d}-00", "prompt_index": i, "prompt_sha256": "", "turn": 0,
                     "split": "validation" if i % 10 == 0 else "train",
                     "input_ids": [rnd.randrange(vocab) for _ in range(t)], "loss_mask": [0] * p + [1] * (t - p),
                     "num_prompt_tokens": p, "num_completion_tokens": t - p, "finish_reason": "length",
                     "reasoning": None, "content": ""})
    stage.commit_shard("rows", {"rows.jsonl": "".join(json.dumps(r) + "\n" for r in rows).encode()}, {})
    stage.complete({})


@contextmanager
def moto_s3():
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="bench")
    try:
        yield "s3://bench/runs"
    finally:
        server.stop()
