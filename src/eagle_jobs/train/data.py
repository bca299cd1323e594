"""What a draft trains on: the vocab mapping's token counts, the shards staged to bounded local disk
(ShardStager), and the hidden-state samples as speculators' datasets and loaders: read from staged shards,
or by range reads from the store until a shard is staged; with train.source stream, read from the shards
extraction is still committing, batched in the stream's order.

The datasets are importable by name, and this module stays light to import (no model code; the recipe
and draft shape only for type checking): with `train.num_workers` > 0 speculators' DataLoader starts its
workers with `spawn`, which pickles the dataset by its importable name. Untrusted bytes still never meet
pickle: the workers are handed the store's address and the manifest entries (JSON values), and decode the
safetensors bytes themselves.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from speculators.train.data import BaseDataset
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2, _assign_to_packed_batches

from eagle_jobs.committed import iter_rows, read_sample_bytes
from eagle_jobs.errors import BadInput
from eagle_jobs.hsformat import decode_sample
from eagle_jobs.layout import StageName
from eagle_jobs.progress import console
from eagle_jobs.records import ExtractionInfo, ExtractManifest, FileEntry, SampleEntry
from eagle_jobs.store import Stage, Store
from eagle_jobs.stream.feed import StreamFeed, first_worker_count, stream_groups, wait_committed

if TYPE_CHECKING:
    from eagle_jobs.draft import DraftShape
    from eagle_jobs.recipe import Recipe


def staged_name(fname: str, info: FileEntry) -> str:
    """A shard's name on local disk, content-addressed: a staged copy from an earlier extraction can
    never be mistaken for this one."""
    return f"{info['sha256'][:16]}-{fname}"


def read_staged(store: Store, run_id: str, stage_root: str, fname: str, local_name: str,
                e: SampleEntry) -> bytes | bytearray:
    """One sample's bytes: from the shard's staged copy on local disk (ShardStager) once it is
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

    def __init__(self, store_uri: str, run_id: str, items: list[tuple[str, str, SampleEntry]], stage_root: str,
                 max_len: int, dtype: torch.dtype):
        self.store_uri, self.run_id, self.items, self.stage_root = store_uri, run_id, items, stage_root
        self._store: Store | None = None  # opened in the process that reads (a worker, with num_workers > 0)
        super().__init__(max_len, dtype)

    def _compute_approx_lengths(self):
        return [min(e["num_tokens"], self.max_len) for _f, _l, e in self.items]

    def __len__(self):
        return len(self.items)

    def _read(self, fname: str, local_name: str, e: SampleEntry) -> bytes | bytearray:
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
        self.stage_root = stage_root  # the shards ShardStager keeps on local disk for later epochs
        self._store: Store | None = None
        # shard -> (file, its staged name, entries, skipped)
        self._entries: dict[str, tuple[str, str, dict[str, SampleEntry], set[str]]] = {}
        super().__init__(max_len, dtype)

    def _compute_approx_lengths(self):
        return [min(n, self.max_len) for _s, _r, n in self.items]

    def __len__(self):
        return len(self.items)

    def _shard(self, name: str) -> tuple[str, str, dict[str, SampleEntry], set[str]]:
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


class ShardStager:
    """Copies committed shards to bounded local disk ahead of the trainer (one per node).

    Readers use the local copy once it is there and range-read the store until
    then, so training never waits for a whole shard and local disk stays under
    `train.local_stage_bytes`. Stored mode stages the extraction's shards in order; streaming
    stages each shard a later epoch reads again as it commits (`stream.committed_in_order`).
    """

    def __init__(self, store: Store, run_id: str, manifests: Iterable[ExtractManifest], root: Path, budget: int):
        self.store, self.root, self.budget = store, root, budget
        self.stage = Stage(store, run_id, StageName.EXTRACT.dir)
        self.manifests = manifests
        root.mkdir(parents=True, exist_ok=True)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        used = 0
        for m in self.manifests:
            (fname, info), = m["files"].items()
            if used + info["size"] > self.budget:
                return
            dest = self.root / staged_name(fname, info)
            if not dest.exists():
                data = self.stage.read(fname, info)  # sha256-checked against the manifest
                tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, dest)
            used += info["size"]

    def start(self) -> "ShardStager":
        self.thread.start()
        return self


def token_frequencies(manifests: list[ExtractManifest], store: Store, run_id: str,
                      cache: Path | None = None) -> Counter:
    """Counts of loss-masked target tokens in the training split (speculators' token_freq): of the
    extracted training samples, or (streaming, no manifests yet) of the training split's rows.

    Reading every capture row takes minutes at the Kimi recipe's scale (1.5 B tokens of JSON): with `cache`
    (a file in the node's work dir, named for what it counts), the first rank of a node counts and the
    others, holding its lock, read the counts."""
    if cache is None:
        return _count_tokens(manifests, store, run_id)
    import fcntl

    from eagle_jobs.layout import content_hash

    key = content_hash([run_id, (Stage(store, run_id, StageName.CAPTURE.dir).completion() or {}).get("completed_at"),
                        sorted((m["shard"], sorted(f["sha256"] for f in m["files"].values())) for m in manifests)], 16)
    path = cache.with_name(f"{cache.name}-{key}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if path.exists():
            return Counter({int(t): n for t, n in json.loads(path.read_text()).items()})
        freq = _count_tokens(manifests, store, run_id)
        tmp = path.with_name(f"{path.name}.part-{os.getpid()}")
        tmp.write_text(json.dumps(freq))
        os.replace(tmp, path)
        return freq


def _count_tokens(manifests: list[ExtractManifest], store: Store, run_id: str) -> Counter:
    extracted = {e["row_id"] for m in manifests for e in m["samples"] if e["split"] == "train"}
    freq: Counter = Counter()
    for r in iter_rows(store, run_id):  # a few capture shards at a time: the counts, never the rows, stay
        if r["row_id"] in extracted if manifests else r["split"] == "train":
            freq.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return freq


def vocab_mapping(info: ExtractionInfo, store: Store, run_id: str, shape: DraftShape,
                  work: Path | None = None) -> tuple:
    """speculators' d2t/t2d from the loss-masked token counts, and the share of target tokens it covers."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq = token_frequencies(info["manifests"], store, run_id, work / "token-frequencies" if work else None)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), shape.draft_vocab_size, shape.verifier_vocab_size)
    coverage = sum(c for t, c in freq.items() if t2d[t]) / max(1, sum(freq.values()))
    console.print(f"  vocab mapping: {shape.draft_vocab_size} of {shape.verifier_vocab_size} tokens, "
                  f"covering {coverage:.1%} of {sum(freq.values()):,} training target tokens")
    return d2t, t2d, coverage


@dataclass
class TrainData:
    """The samples of each split (shard, local name, manifest entry) and their loaders."""

    items: dict[str, list]
    train_loader: object
    val_loader: object | None
    feed: StreamFeed | None = None  # train.source stream: what the window needs from training

    @classmethod
    def create(cls, recipe: Recipe, store: Store, run_id: str, info: ExtractionInfo, shape: DraftShape, work: Path,
               hs_dtype: torch.dtype) -> TrainData:
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.dataloader import _setup_dataloader
        from speculators.train.distributed import get_local_rank

        if recipe.train.source == "stream":
            return cls.streamed(recipe, store, run_id, info, shape, work, hs_dtype)

        stager = ShardStager(store, run_id, info["manifests"], work / "stage", recipe.train.local_stage_bytes)
        if get_local_rank() == 0:  # one stager per node; the other ranks read what it staged
            stager.start()
        items: dict[str, list[tuple[str, str, SampleEntry]]] = {"train": [], "validation": []}
        for m in info["manifests"]:
            (fname, finfo), = m["files"].items()
            for e in m["samples"]:
                if e["loss_tokens"] > 1:
                    items[e["split"]].append((fname, staged_name(fname, finfo), e))
        if not items["train"]:
            raise BadInput(f"run '{run_id}' has no training samples with loss tokens")

        T = recipe.train.total_seq_len

        def loader(split: str):
            if not items[split]:
                return None
            ds = StoreHiddenStatesDataset(store.uri, run_id, items[split], str(stager.root), T, hs_dtype)
            return _setup_dataloader(ds, T, shape.hidden_size, num_workers=recipe.train.num_workers,
                                     num_target_layers=len(recipe.aux_layer_ids), prefetch_factor=4,
                                     preprocess=shift_batch, seed=recipe.train.seed)

        return cls(items, loader("train"), loader("validation"))


    @classmethod
    def streamed(cls, recipe: Recipe, store: Store, run_id: str, info: ExtractionInfo, shape: DraftShape, work: Path,
                 hs_dtype: torch.dtype) -> TrainData:
        """train.source stream: the stream's shards (eagle_jobs.stream), batched in commit order."""
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.dataloader import _setup_dataloader
        from speculators.train.distributed import get_dp_rank, get_dp_size, get_local_rank

        from eagle_jobs import speculators_compat as compat
        from eagle_jobs import stream
        from eagle_jobs.hsformat import bytes_per_token

        t, reextract = recipe.train, recipe.train.later_epochs == "re-extract"
        rows = {r.row_id: r for r in info["rows"]}
        bpt = bytes_per_token(len(info["layer_ids"]), info["hidden_size"], info["storage"])
        order = stream.StreamPlan(list(rows.values()), bpt, recipe.extract.shard_bytes,
                                  first_worker_count(store, run_id), t.epochs if reextract else 1).order
        window = recipe.store.window_bytes or 0
        # a step packs samples clipped to total_seq_len, but reads them whole from the store
        stream.check_window(window, max(t.total_seq_len, recipe.limits.max_seq_len) * bpt * get_dp_size())
        groups = stream_groups([s for s in order if s.split == "train" and s.pass_index == 0],
                               window // stream.GROUP_SHARE)
        items: dict[str, list] = {"train": [], "validation": []}
        index_groups: list[list[int]] = []
        for g in groups:
            index_groups.append([])
            for s in g:
                for rid in s.row_ids:
                    if rows[rid].loss_tokens > 1:
                        index_groups[-1].append(len(items["train"]))
                        items["train"].append((s.name, rid, rows[rid].num_tokens))
        for s in order:
            if s.split == "validation":
                items["validation"] += [(s.name, rid, rows[rid].num_tokens) for rid in s.row_ids
                                        if rows[rid].loss_tokens > 1]
        if not items["train"]:
            raise BadInput(f"run '{run_id}' has no training rows with loss tokens")
        names, T = [s.name for s in order], t.total_seq_len
        # the node cache: each shard a later epoch reads again, staged to local disk as it commits (the
        # validation shards, every epoch; the training shards, in keep mode), within train.local_stage_bytes
        again = [s.name for s in order if t.epochs > 1 and (s.split == "validation" or not reextract)]
        stager = ShardStager(store, run_id, stream.committed_in_order(store, run_id, again), work / "stage",
                             t.local_stage_bytes)
        if again and get_local_rank() == 0:  # one stager per node; the other ranks read what it staged
            stager.start()
        ds = StreamHiddenStatesDataset(store.uri, run_id, items["train"], names, str(stager.root), T, hs_dtype)
        sampler = StreamBatchSampler(ds.approx_lengths, index_groups, reextract, T, get_dp_size(), get_dp_rank(),
                                     t.seed)
        layers = len(recipe.aux_layer_ids)
        train = compat.stream_dataloader(ds, sampler, T, shape.hidden_size, t.num_workers, layers, shift_batch)
        val = None
        if items["validation"]:
            vds = StreamHiddenStatesDataset(store.uri, run_id, items["validation"], names, str(stager.root), T,
                                            hs_dtype)
            val = _setup_dataloader(vds, T, shape.hidden_size, num_workers=t.num_workers, num_target_layers=layers,
                                    prefetch_factor=4, preprocess=shift_batch, seed=t.seed)
        console.print(f"  stream: {len(order)} shards planned ({len(groups)} shuffle groups), window "
                      f"{stream.mib(window)}, later epochs {t.later_epochs}")
        feed = StreamFeed(store, run_id, sampler, groups, reextract, window, stream.consumed(store, run_id))
        if get_dp_rank() == 0:  # extraction's window wait tells a slow trainer from a gone one by this mark
            stream.TrainingAlive(store, run_id).start()
        return cls(items, train, val, feed)
