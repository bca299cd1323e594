"""The hidden-state samples a draft trains on, as speculators' dataset: read from staged shards, or
by range reads from the store until a shard is staged (train.ShardStager); with train.source stream,
read from the shards extraction is still committing, batched in the stream's order.

A module of its own, not a class inside the train entry: with `train.num_workers` > 0
speculators' DataLoader starts its workers with `spawn`, which pickles the dataset by its
importable name. Untrusted bytes still never meet pickle: the workers are handed the store's
address and the manifest entries (JSON values), and decode the safetensors bytes themselves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from speculators.train.data import BaseDataset
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2, _assign_to_packed_batches

from eagle_jobs.committed import read_sample_bytes
from eagle_jobs.hsformat import decode_sample
from eagle_jobs.store import Store


def staged_name(fname: str, info: dict) -> str:
    """A shard's name on local disk, content-addressed: a staged copy from an earlier extraction can
    never be mistaken for this one."""
    return f"{info['sha256'][:16]}-{fname}"


def read_staged(store: Store, run_id: str, stage_root: str, fname: str, local_name: str, e: dict) -> bytes | bytearray:
    """One sample's bytes: from the shard's staged copy on local disk (train.ShardStager) once it is
    there, else by a range read from the store."""
    local = Path(stage_root) / local_name
    if local.exists():
        buf = bytearray(e["length"])  # read straight into memory the tensors then share
        with open(local, "rb") as f:
            f.seek(e["start"])
            if f.readinto(buf) != e["length"]:
                raise OSError(f"{local}: shorter than its manifest says; delete it to stage it again")
        return buf
    return read_sample_bytes(store, run_id, fname, e)


class StoreHiddenStatesDataset(BaseDataset):
    """Samples of one split: (shard file, staged name, manifest entry) each."""

    def __init__(self, store_uri: str, run_id: str, items: list[tuple[str, str, dict]], stage_root: str,
                 max_len: int, dtype: torch.dtype):
        self.store_uri, self.run_id, self.items, self.stage_root = store_uri, run_id, items, stage_root
        self._store: Store | None = None  # opened in the process that reads (a worker, with num_workers > 0)
        super().__init__(max_len, dtype)

    def _compute_approx_lengths(self):
        return [min(e["num_tokens"], self.max_len) for _f, _l, e in self.items]

    def __len__(self):
        return len(self.items)

    def _read(self, fname: str, local_name: str, e: dict) -> bytes | bytearray:
        if self._store is None:
            self._store = Store.open(self.store_uri)
        return read_staged(self._store, self.run_id, self.stage_root, fname, local_name, e)

    def _get_raw_data(self, index: int):
        s = decode_sample(self._read(*self.items[index]), self.items[index][2], self.hidden_states_dtype)
        hs = s["hidden_states"]  # [T, L, H]: aux layers, then the final layer
        return {"hidden_states": hs[:, :-1].flatten(1), "input_ids": s["token_ids"],
                "verifier_last_hidden_states": hs[:, -1], "loss_mask": s["loss_mask"]}


class StreamHiddenStatesDataset(BaseDataset):
    """train.source stream: samples of shards extraction is still committing, read in the stream's order.

    Item i is (shard of pass 0, row id, tokens); index `p * len(items) + i` is item i of extraction
    pass p (StreamBatchSampler numbers re-extracted epochs so). A read waits until its shard's manifest
    is committed (the manifest is the commit: the object is whole before it), saying how far behind
    extraction training is; a row extraction skipped is speculators' SampleUnavailable, left out of its batch.
    """

    def __init__(self, store_uri: str, run_id: str, items: list[tuple[str, str, int]], order: list[str],
                 stage_root: str, max_len: int, dtype: torch.dtype):
        self.store_uri, self.run_id, self.items, self.order = store_uri, run_id, items, order
        self.stage_root = stage_root  # the shards train.ShardStager keeps on local disk for later epochs
        self._store: Store | None = None
        # shard -> (file, its staged name, entries, skipped)
        self._entries: dict[str, tuple[str, str, dict[str, dict], set[str]]] = {}
        super().__init__(max_len, dtype)

    def _compute_approx_lengths(self):
        return [min(n, self.max_len) for _s, _r, n in self.items]

    def __len__(self):
        return len(self.items)

    def _shard(self, name: str) -> tuple[str, str, dict[str, dict], set[str]]:
        if name not in self._entries:
            if self._store is None:
                self._store = Store.open(self.store_uri)
            m = wait_committed(self._store, self.run_id, name, self.order)
            (fname, finfo), = m["files"].items()
            if len(self._entries) >= 256:  # a shuffle group's shards at a time, not the whole stream's
                self._entries.pop(next(iter(self._entries)))
            self._entries[name] = (fname, staged_name(fname, finfo), {e["row_id"]: e for e in m["samples"]},
                                   {k["row_id"] for k in m["skipped"]})
        return self._entries[name]

    def _get_raw_data(self, index: int):
        from speculators.train.recovery import SampleUnavailable

        from eagle_jobs.stream import pass_name

        p, i = divmod(index, len(self.items))
        shard, row_id, _n = self.items[i]
        name = pass_name(shard, p)
        fname, local_name, entries, skipped = self._shard(name)
        e = entries.get(row_id)
        if e is None and row_id in skipped:
            return SampleUnavailable(reason=f"{row_id}: skipped by extraction")
        if e is None:
            from eagle_jobs.errors import BadInput

            raise BadInput(f"train: extraction shard {name} of run '{self.run_id}' does not hold row {row_id}, which "
                           "the stream's plan puts there: it was extracted in stored mode or with other settings; "
                           "stream into a new run id, or train with train.source: stored")
        assert self._store is not None
        s = decode_sample(read_staged(self._store, self.run_id, self.stage_root, fname, local_name, e), e,
                          self.hidden_states_dtype)
        hs = s["hidden_states"]
        return {"hidden_states": hs[:, :-1].flatten(1), "input_ids": s["token_ids"],
                "verifier_last_hidden_states": hs[:, -1], "loss_mask": s["loss_mask"]}


def wait_committed(store: Store, run_id: str, shard: str, order: list[str]) -> dict:
    """The manifest of `shard` once extraction commits it; says where training is in the stream."""
    import time

    from eagle_jobs import stream
    from eagle_jobs.errors import BadInput
    from eagle_jobs.heartbeat import beat
    from eagle_jobs.layout import StageName
    from eagle_jobs.progress import console
    from eagle_jobs.store import Stage

    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    pos, started, last = order.index(shard), time.monotonic(), None
    while (m := stage.manifest(shard)) is None:
        stream.check_not_failed(store, run_id)
        if last is None:  # extraction lets the shard training is blocked on through a full window
            stream.mark_waiting(store, run_id, shard)
        beat()  # waiting for extraction is progress (stream.Window.wait)
        if stage.is_complete() and stage.manifest(shard) is None:
            raise BadInput(f"train: extraction of run '{run_id}' completed without shard {shard} of the stream "
                           "plan: were the rows or the recipe changed? rerun extract with this recipe")
        now = time.monotonic()
        if last is None or now - last >= stream.REPORT_S:
            have = len(stage.store.list(stage.key("manifests")))
            console.print(f"  stream: training waits for shard {pos + 1} of {len(order)} ({shard}); extraction "
                          f"has committed {have} ({now - started:.0f} s)", markup=False, highlight=False)
            last = now
        time.sleep(stream.POLL_S)
    have = len(stage.store.list(stage.key("manifests")))
    console.print(f"  stream: reading shard {pos + 1} of {len(order)}; extraction has committed {have}, "
                  f"{max(0, have - pos - 1)} ahead of training", markup=False, highlight=False)
    return m


class StreamBatchSampler(MultipackDistributedBatchSamplerV2):
    """speculators' packing sampler over the stream's order: shuffled only within groups of consecutive
    shards (so a batch never needs a shard far ahead of the one being read), and in a re-extract run
    epoch p's indices point at extraction pass p. Its fast-skip resume (`_cached_generated_batches`)
    works unchanged."""

    def __init__(self, lengths: list[int], groups: list[list[int]], reextract: bool, batch_max_length: int,
                 num_replicas: int, rank: int, seed: int):
        super().__init__(batch_max_length=batch_max_length, lengths=lengths, num_replicas=num_replicas, rank=rank,
                         seed=seed)
        self.groups, self.reextract = groups, reextract
        self._done_after: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=int))

    def _order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng(self.seed + epoch)
        return np.concatenate([rng.permutation(np.asarray(g, dtype=int)) for g in self.groups])

    def _packed(self, order: np.ndarray, rank: int) -> list[np.ndarray]:
        return _assign_to_packed_batches(self.lengths[order], self.batch_max_length, rank, self.num_replicas)

    def _generate_batches(self, epoch: int) -> list[np.ndarray]:
        if self._cached_generated_batches[0] == epoch:
            return self._cached_generated_batches[1]
        order = self._order(epoch)
        offset = epoch * len(self.lengths) if self.reextract else 0
        batches = [order[b] + offset for b in self._packed(order, self.rank)]
        self._cached_generated_batches = (epoch, batches)
        return batches

    def groups_done(self, epoch: int, steps: int) -> int:
        """How many leading groups every rank has finished after `steps` steps of `epoch`: each step packs
        the next run of the order across all ranks, so everything up to the furthest position is read."""
        if self._done_after[0] != epoch:
            order = self._order(epoch)
            group_end = np.cumsum([len(g) for g in self.groups])  # after each group (an empty one: its neighbour's)
            per_rank = [[max(b, default=-1) for b in self._packed(order, r)] for r in range(self.num_replicas)]
            furthest = np.maximum.accumulate(np.max(np.array(per_rank), axis=0))  # after step j+1
            self._done_after = (epoch, np.searchsorted(group_end, furthest + 1, side="right"))
        done = self._done_after[1]
        if steps >= len(done):
            return len(self.groups)  # the epoch's end: the dropped tail, and any empty group, are done too
        return int(done[steps - 1]) if steps > 0 else 0
