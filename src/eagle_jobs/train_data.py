"""The hidden-state samples a draft trains on, as speculators' dataset: read from staged shards, or
by range reads from the store until a shard is staged (train.ShardStager).

A module of its own, not a class inside the train entry: with `train.num_workers` > 0
speculators' DataLoader starts its workers with `spawn`, which pickles the dataset by its
importable name. Untrusted bytes still never meet pickle: the workers are handed the store's
address and the manifest entries (JSON values), and decode the safetensors bytes themselves.
"""

from __future__ import annotations

from pathlib import Path

import torch
from speculators.train.data import BaseDataset

from eagle_jobs.committed import read_sample_bytes
from eagle_jobs.hsformat import decode_sample
from eagle_jobs.store import Store


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
        local = Path(self.stage_root) / local_name
        if local.exists():
            buf = bytearray(e["length"])  # read straight into memory the tensors then share
            with open(local, "rb") as f:
                f.seek(e["start"])
                if f.readinto(buf) != e["length"]:
                    raise OSError(f"{local}: shorter than its manifest says; delete it to stage it again")
            return buf
        if self._store is None:
            self._store = Store.open(self.store_uri)
        return read_sample_bytes(self._store, self.run_id, fname, e)

    def _get_raw_data(self, index: int):
        s = decode_sample(self._read(*self.items[index]), self.items[index][2], self.hidden_states_dtype)
        hs = s["hidden_states"]  # [T, L, H]: aux layers, then the final layer
        return {"hidden_states": hs[:, :-1].flatten(1), "input_ids": s["token_ids"],
                "verifier_last_hidden_states": hs[:, -1], "loss_mask": s["loss_mask"]}
