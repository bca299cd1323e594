"""The stream's plan: every extraction worker's shards, in the order extraction commits them and training
reads them (eagle_jobs.stream), planned once from the committed rows by extract, train and `plan`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from eagle_jobs.errors import BadInput
from eagle_jobs.records import RowRef, Split
from eagle_jobs.sharding import owned, plan_shards, shard_name


@dataclass(frozen=True)
class StreamShard:
    """One shard of the stream: extraction's shard name, its pass, and the rows it holds."""

    name: str
    worker: int
    pass_index: int
    split: Split
    row_ids: tuple[str, ...]
    planned_bytes: int

    @property
    def fname(self) -> str:
        return f"{self.name}.safetensors"


def pass_name(name: str, pass_index: int) -> str:
    """Pass 0 keeps the stored mode's shard name; a re-extracted pass gets a suffix."""
    return name if pass_index == 0 else f"{name}-pass{pass_index:03d}"


def worker_stream(rows: Sequence[RowRef], bytes_per_tok: int, shard_bytes: int, index: int, num: int,
                  passes: int) -> list[StreamShard]:
    """Worker `index` of `num`'s shards in the order it extracts them."""
    mine = owned(rows, index, num)
    val = plan_shards([r for r in mine if r.split != "train"], bytes_per_tok, shard_bytes)
    train = plan_shards([r for r in mine if r.split == "train"], bytes_per_tok, shard_bytes)
    out: list[StreamShard] = []

    def add(shard_rows: list[RowRef], k: int, split: Split, p: int) -> None:
        size = sum(r.num_tokens for r in shard_rows) * bytes_per_tok
        out.append(StreamShard(pass_name(shard_name(index, num, k), p), index, p, split,
                               tuple(r.row_id for r in shard_rows), size))

    for k, s in enumerate(val):
        add(s, k, "validation", 0)
    for p in range(passes):
        for k, s in enumerate(train, start=len(val)):
            add(s, k, "train", p)
    return out


@dataclass(frozen=True)
class StreamPlan:
    """The stream, planned once: every worker's shards and the order they commit and are read in.

    Built from the committed rows, the stored bytes per token (storage dtype resolved: hsformat.resolve_storage),
    the shard size, the extraction's worker count and its passes (the epochs, with re-extract; else one)."""

    rows: Sequence[RowRef]
    bytes_per_token: int
    shard_bytes: int
    num_workers: int
    passes: int

    @functools.cached_property
    def per_worker(self) -> list[list[StreamShard]]:
        return [worker_stream(self.rows, self.bytes_per_token, self.shard_bytes, w, self.num_workers, self.passes)
                for w in range(self.num_workers)]

    def worker(self, index: int) -> list[StreamShard]:
        """Worker `index`'s shards in the order it extracts them."""
        return self.per_worker[index]

    @functools.cached_property
    def order(self) -> list[StreamShard]:
        """Every worker's shards, interleaved (the i-th of each worker in turn): the order they commit
        in when the workers keep pace, and the order training reads them in."""
        per = self.per_worker
        return [lst[i] for i in range(max(map(len, per), default=0)) for lst in per if i < len(lst)]


def num_workers_of(shard: str) -> int:
    """The worker count a shard name was planned for (`00001-of-00004-00007`)."""
    try:
        return int(shard.split("-of-", 1)[1][:5])
    except (IndexError, ValueError):
        raise BadInput(f"extraction shard '{shard}' is not a worker shard name: rerun extract") from None


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"
