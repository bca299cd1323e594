"""Deterministic work assignment for Indexed-Job workers.

Worker i of n owns items i, i+n, i+2n, ... of the stage's input, in input order,
so the split depends only on (input, n): a restarted worker recomputes the same
list and resumes at its first uncommitted shard.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

from eagle_jobs.errors import BadInput

T = TypeVar("T")


def worker_index(shard_index: int | None) -> int:
    """The --shard-index flag, else the Indexed Job's JOB_COMPLETION_INDEX (set by Kubernetes), else 0."""
    if shard_index is None:
        env = os.environ.get("JOB_COMPLETION_INDEX")
        shard_index = int(env) if env not in (None, "") else 0
    return shard_index


def resolve_worker(shard_index: int | None, num_shards: int | None) -> tuple[int, int]:
    """CLI flags win; inside an Indexed Job the defaults come from the Job itself.

    JOB_COMPLETION_INDEX is set by Kubernetes; the completion count has no
    standard variable, so our manifests copy `completions` into EAGLE_JOBS_NUM_SHARDS.
    """
    shard_index = worker_index(shard_index)
    if num_shards is None:
        env = os.environ.get("EAGLE_JOBS_NUM_SHARDS")
        num_shards = int(env) if env not in (None, "") else 1
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise BadInput(f"--shard-index {shard_index} --num-shards {num_shards}: need 0 <= index < num-shards")
    return shard_index, num_shards


def owned(items: Sequence[T], index: int, num: int) -> list[T]:
    return list(items[index::num])


def chunked(items: Sequence[T], size: int) -> list[list[T]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def worker_tag(index: int, num: int) -> str:
    return f"{index:05d}-of-{num:05d}"
