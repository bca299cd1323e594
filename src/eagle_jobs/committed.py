"""What one stage reads of another stage's committed output: the layer below the stages.

Stages are peers (capture, extract, train, evaluate never import each other); each reads
its inputs through these readers, which know the stores' layout (docs/FORMAT.md) and
nothing of how the stage that wrote it works.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import cast

from eagle_jobs.errors import BadInput, NotReady
from eagle_jobs.layout import StageName, train_dir
from eagle_jobs.records import (
    CaptureManifest,
    CheckpointManifest,
    ExtractionInfo,
    ExtractManifest,
    Row,
    RowRef,
    SampleEntry,
)
from eagle_jobs.store import Stage, Store, nearby_runs


# The typed readers of each stage's manifests: its writer commits records.<Stage>Fields on top of the
# commit's own fields (Stage.commit_shard), so what a reader gets back is that stage's Manifest type.
def capture_manifests(stage: Stage) -> list[CaptureManifest]:
    return cast(list[CaptureManifest], stage.manifests())


def extract_manifests(stage: Stage, names: list[str] | None = None) -> list[ExtractManifest]:
    return cast(list[ExtractManifest], stage.manifests(names))


def extract_manifest(stage: Stage, shard: str) -> ExtractManifest | None:
    return cast(ExtractManifest | None, stage.manifest(shard))


def checkpoint_manifest(stage: Stage, shard: str) -> CheckpointManifest | None:
    """A train stage's checkpoint or final/ manifest."""
    return cast(CheckpointManifest | None, stage.manifest(shard))


def _index_entry(r: Row, start: int, length: int) -> list:
    """One entry of a capture manifest's `row_index` (docs/FORMAT.md#capture)."""
    return [r["row_id"], r["split"], len(r["input_ids"]), sum(r["loss_mask"]), start, length]


def encode_rows(rows: list[Row]) -> tuple[bytes, list[list]]:
    """A capture shard's JSONL bytes, one row a line, and its manifest's `row_index`."""
    lines = [(json.dumps(r, ensure_ascii=False) + "\n").encode() for r in rows]
    index, start = [], 0
    for r, line in zip(rows, lines):
        index.append(_index_entry(r, start, len(line)))
        start += len(line)
    return b"".join(lines), index


def row_refs(blob: bytes) -> list[list]:
    """The `row_index` of a capture shard committed without one, from its JSONL `blob`."""
    out, start = [], 0
    for line in blob.splitlines(keepends=True):
        out.append(_index_entry(json.loads(line), start, len(line)))
        start += len(line)
    return out


def _capture_stage(store: Store, run_id: str, require_complete: bool) -> Stage:
    stage = Stage(store, run_id, StageName.CAPTURE.dir)
    if require_complete and not stage.is_complete():
        raise NotReady(f"capture of run '{run_id}' is not complete in {store.uri}: run `eagle-jobs capture` first")
    return stage


def row_index(store: Store, run_id: str, require_complete: bool = True) -> list[RowRef]:
    """Every committed capture row of a run as a RowRef, in row-id order: from the capture manifests
    alone (read concurrently), except a shard committed without a `row_index`, which is read once."""
    stage = _capture_stage(store, run_id, require_complete)
    refs: list[RowRef] = []
    for m in capture_manifests(stage):
        (fname, info), = m["files"].items()
        shard = fname.rsplit(".", 1)[0]
        entries = m.get("row_index")
        if entries is None:
            entries = row_refs(stage.read(fname, info))
        refs += [RowRef(rid, split, n, loss, shard, start, length) for rid, split, n, loss, start, length in entries]
    if not refs:
        raise BadInput(f"capture of run '{run_id}' committed no rows: check the prompt set and limits")
    return sorted(refs, key=lambda r: r.row_id)


def load_rows(store: Store, run_id: str, refs: list[RowRef], max_gap: int = 1 << 20) -> list[Row]:
    """The rows of `refs`, in their order: one range read per run of nearby rows of a capture shard
    (rows closer than `max_gap` bytes share a read), never a whole shard for one row."""
    stage = Stage(store, run_id, StageName.CAPTURE.dir)
    got: dict[str, Row] = {}
    by_shard: dict[str, list[RowRef]] = {}
    for r in refs:
        by_shard.setdefault(r.shard, []).append(r)
    for shard, rs in by_shard.items():
        key = stage.key(f"data/{shard}.jsonl")
        for run in nearby_runs(rs, lambda r: (r.start, r.length), max_gap):
            lo = run[0].start
            blob = store.get(key, lo, run[-1].start + run[-1].length)
            for r in run:
                row = json.loads(blob[r.start - lo : r.start - lo + r.length])
                if row["row_id"] != r.row_id:
                    raise BadInput(f"capture shard {store.url(key)}: bytes {r.start}+{r.length} hold row "
                                   f"{row['row_id']}, its manifest says {r.row_id}; rerun capture")
                got[r.row_id] = row
    return [got[r.row_id] for r in refs]


def iter_rows(store: Store, run_id: str, require_complete: bool = True, at_once: int = 8) -> Iterator[Row]:
    """Every committed capture row, in shard order, `at_once` shards read together (sha256-checked against
    their manifests): memory of that many shards, never the corpus."""
    stage = _capture_stage(store, run_id, require_complete)
    files = [(fname, info) for m in stage.manifests() for fname, info in m["files"].items()]
    for i in range(0, len(files), at_once):
        for data in stage.read_many(files[i : i + at_once]):
            for line in data.splitlines():
                yield json.loads(line)


def read_rows(store: Store, run_id: str, require_complete: bool = True) -> list[Row]:
    """Every committed capture row of a run as Row objects, in row-id order: for tests and small runs.
    A stage plans with `row_index` and reads the rows of one shard at a time (`load_rows`)."""
    rows = list(iter_rows(store, run_id, require_complete))
    if not rows:
        raise BadInput(f"capture of run '{run_id}' committed no rows: check the prompt set and limits")
    return sorted(rows, key=lambda r: r["row_id"])


def extraction_info(store: Store, run_id: str) -> ExtractionInfo:
    """What the train/evaluate stages need to know about a committed extraction."""
    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    if not stage.is_complete():
        raise NotReady(f"extract of run '{run_id}' is not complete in {store.uri}: run `eagle-jobs extract` first")
    manifests = extract_manifests(stage)
    if not manifests:
        raise BadInput(f"extract of run '{run_id}' has no shards")
    ids = {tuple(m["layer_ids"]) for m in manifests}
    if len(ids) != 1:
        raise BadInput(f"extract of run '{run_id}': shards disagree on layer ids {sorted(ids)}; rerun extraction")
    return {"manifests": manifests, "layer_ids": list(ids.pop()), "hidden_size": manifests[0]["hidden_size"],
            "storage": manifests[0]["storage"]}


def read_sample_bytes(store: Store, run_id: str, fname: str, entry: SampleEntry) -> bytes:
    """One sample's bytes from shard `fname` of the run's extraction: one range read, never the
    whole object (a Kimi-size shard is tens of GB)."""
    key = Stage(store, run_id, StageName.EXTRACT.dir).key(f"data/{fname}")
    return store.get(key, entry["start"], entry["start"] + entry["length"])


def read_sample(store: Store, run_id: str, manifest: ExtractManifest, entry: SampleEntry, dtype=None) -> dict:
    """One decoded hidden-state sample of a shard's manifest, as dtype (default bfloat16). torch is
    imported here, not above: the pod's prepare container reads the final draft through this module."""
    import torch

    from eagle_jobs.hsformat import decode_sample

    dtype = torch.bfloat16 if dtype is None else dtype
    (fname,) = manifest["files"]
    return decode_sample(read_sample_bytes(store, run_id, fname, entry), entry, dtype)


def tau_estimate(val: dict, k: int) -> float | None:
    """The one teacher-forced τ estimate, from one validation of training's metrics: 1 + Σ_{i<k} full_acc_i,
    speculators' share of held-out positions whose first i+1 draft tokens are all right, over the draft
    steps training validated (train.ttt_steps of them); None where it validated none. Training picks its
    epoch by it and the report shows it beside the served τ."""
    accs = [a for a in (val.get(f"full_acc_{i}_epoch") for i in range(k)) if a is not None]
    return 1 + sum(accs) if accs else None


def download_final(store: Store, run_id: str, dest: Path, variant: str | None = None) -> Path:
    """The committed final draft checkpoint as a local directory (for evaluate / inspect / vLLM)."""
    stage = Stage(store, run_id, train_dir(variant))
    m = checkpoint_manifest(stage, "final")
    if m is None:
        what = f"variant '{variant}' of run '{run_id}'" if variant else f"train of run '{run_id}'"
        raise NotReady(f"{what} has no committed final checkpoint in {store.uri}: run `eagle-jobs "
                       f"{'compare' if variant else 'train'}`")
    dest.mkdir(parents=True, exist_ok=True)
    for f, info in m["files"].items():
        (dest / f.split("/", 1)[1]).write_bytes(stage.read(f, info))
    return dest
