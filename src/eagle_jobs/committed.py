"""What one stage reads of another stage's committed output: the layer below the stages.

Stages are peers (capture, extract, train, evaluate never import each other); each reads
its inputs through these readers, which know the stores' layout (docs/FORMAT.md) and
nothing of how the stage that wrote it works.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle_jobs.errors import BadInput, NotReady
from eagle_jobs.layout import StageName, train_dir
from eagle_jobs.records import Row
from eagle_jobs.store import Stage, Store


def read_rows(store: Store, run_id: str, require_complete: bool = True) -> list[Row]:
    """Every committed capture row of a run, in row-id order."""
    stage = Stage(store, run_id, StageName.CAPTURE.dir)
    if require_complete and not stage.is_complete():
        raise NotReady(f"capture of run '{run_id}' is not complete in {store.uri}: run `eagle-jobs capture` first")
    rows = []
    for _m, _f, data in stage.iter_objects():
        for line in data.decode().splitlines():
            rows.append(json.loads(line))
    if not rows:
        raise BadInput(f"capture of run '{run_id}' committed no rows: check the prompt set and limits")
    return sorted(rows, key=lambda r: r["row_id"])


def extraction_info(store: Store, run_id: str) -> dict:
    """What the train/evaluate stages need to know about a committed extraction."""
    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    if not stage.is_complete():
        raise NotReady(f"extract of run '{run_id}' is not complete in {store.uri}: run `eagle-jobs extract` first")
    manifests = stage.manifests()
    if not manifests:
        raise BadInput(f"extract of run '{run_id}' has no shards")
    ids = {tuple(m["layer_ids"]) for m in manifests}
    if len(ids) != 1:
        raise BadInput(f"extract of run '{run_id}': shards disagree on layer ids {sorted(ids)}; rerun extraction")
    return {"manifests": manifests, "layer_ids": list(ids.pop()), "hidden_size": manifests[0]["hidden_size"],
            "storage": manifests[0]["storage"]}


def read_sample_bytes(store: Store, run_id: str, fname: str, entry: dict) -> bytes:
    """One sample's bytes from shard `fname` of the run's extraction: one range read, never the
    whole object (a Kimi-size shard is tens of GB)."""
    key = Stage(store, run_id, StageName.EXTRACT.dir).key(f"data/{fname}")
    return store.get(key, entry["start"], entry["start"] + entry["length"])


def read_sample(store: Store, run_id: str, manifest: dict, entry: dict, dtype=None) -> dict:
    """One decoded hidden-state sample of a shard's manifest, as dtype (default bfloat16). torch is
    imported here, not above: the pod's prepare container reads the final draft through this module."""
    import torch

    from eagle_jobs.hsformat import decode_sample

    dtype = torch.bfloat16 if dtype is None else dtype
    (fname,) = manifest["files"]
    return decode_sample(read_sample_bytes(store, run_id, fname, entry), entry, dtype)


def download_final(store: Store, run_id: str, dest: Path, variant: str | None = None) -> Path:
    """The committed final draft checkpoint as a local directory (for evaluate / inspect / vLLM)."""
    stage = Stage(store, run_id, train_dir(variant))
    m = stage.manifest("final")
    if m is None:
        what = f"variant '{variant}' of run '{run_id}'" if variant else f"train of run '{run_id}'"
        raise NotReady(f"{what} has no committed final checkpoint in {store.uri}: run `eagle-jobs "
                       f"{'compare' if variant else 'train'}`")
    dest.mkdir(parents=True, exist_ok=True)
    for f, info in m["files"].items():
        (dest / f.split("/", 1)[1]).write_bytes(stage.read(f, info))
    return dest
