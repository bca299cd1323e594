"""Incremental retraining: reuse what other runs in the same store already committed.

Content-addressed: a capture row is reused when another run captured the same
conversation (sha256 of its messages) with the same verifier revision, chat,
sampling and limit settings; a hidden-state sample is reused when another run
extracted the same token ids (sha256) with the same verifier revision, layer ids
and storage dtype. Reused data is copied into this run (its manifests stay the
single source of truth for readers), so a later deletion of the old run changes
nothing here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from eagle_jobs.layout import StageName, content_hash
from eagle_jobs.recipe import Recipe, VllmServerSpec
from eagle_jobs.records import ExtractManifest, FileEntry, Row, SampleEntry
from eagle_jobs.store import Stage, Store

CACHED_SHARDS = 16  # another run's capture shards CaptureIndex keeps parsed: memory of a few shards


def _digest(obj) -> str:
    return content_hash(obj, 16)


def serving(recipe: Recipe, backend: str, server: VllmServerSpec) -> list[str]:
    """Who computed a stage's numbers, and in which dtype: the transformers backend in verifier.dtype,
    vLLM in its --dtype (auto: the checkpoint's). A bf16 server's greedy text and states differ from
    an fp32 one's, so rows and states are reused only between equal servings."""
    if backend == "transformers":
        return [backend, recipe.verifier.dtype]
    dtype = "auto"
    for i, a in enumerate(server.serve_args):
        if a == "--dtype" and i + 1 < len(server.serve_args):
            dtype = server.serve_args[i + 1]
        elif a.startswith("--dtype="):
            dtype = a.split("=", 1)[1]
    return [backend, dtype]


def capture_digest(recipe: Recipe) -> str:
    v = recipe.verifier
    return _digest({"verifier": [v.model, v.revision, v.dtype], "chat": recipe.chat.model_dump(mode="json"),
                    "sampling": recipe.sampling.model_dump(mode="json"),
                    "limits": recipe.limits.model_dump(mode="json"),
                    "serving": serving(recipe, recipe.capture.backend, recipe.capture.vllm)})


def extract_digest(recipe: Recipe) -> str:
    v = recipe.verifier
    return _digest({"verifier": [v.model, v.revision, v.dtype], "aux": recipe.aux_layer_ids,
                    "storage": recipe.extract.storage_dtype,
                    "serving": serving(recipe, recipe.extract.backend, recipe.extract.vllm)})


def ids_sha256(ids: list[int]) -> str:
    return content_hash(ids)  # a list: sort_keys changes nothing, the stored keys stay the same


def other_runs(store: Store, run_id: str) -> list[str]:
    runs = []
    for key in store.list(""):
        name = key.rstrip("/").rsplit("/", 1)[-1]
        if name != run_id and store.exists(f"{name}/capture/manifests"):
            runs.append(name)
    return sorted(runs)


def matching_manifests(store: Store, run_id: str, stage: str, digest: str):
    """(run, manifest) of every other run's committed shards made with the same settings."""
    for run in other_runs(store, run_id):
        for m in Stage(store, run, stage).manifests():
            if m.get("settings_digest") == digest:
                yield run, m


@dataclass
class CaptureIndex:
    """prompt sha256 -> (run, shard file, manifest file info) of committed rows with the same settings."""

    store: Store = field(repr=False, compare=False)
    where: dict[str, tuple[str, str, FileEntry]] = field(default_factory=dict)
    _cache: dict[tuple[str, str], list[Row]] = field(default_factory=dict)

    @classmethod
    def build(cls, store: Store, recipe: Recipe, run_id: str) -> "CaptureIndex":
        idx = cls(store)
        for run, m in matching_manifests(store, run_id, StageName.CAPTURE.dir, capture_digest(recipe)):
            (fname, info), = m["files"].items()
            for sha in m.get("prompt_sha256s", []):
                idx.where.setdefault(sha, (run, fname, info))
        return idx

    def rows_for(self, sha: str) -> list[Row] | None:
        hit = self.where.get(sha)
        if hit is None:
            return None
        run, fname, info = hit
        if (run, fname) not in self._cache:
            if len(self._cache) >= CACHED_SHARDS:  # capture asks shard after shard: the oldest goes
                self._cache.pop(next(iter(self._cache)))
            data = Stage(self.store, run, StageName.CAPTURE.dir).read(fname, info)
            self._cache[(run, fname)] = [json.loads(ln) for ln in data.decode().splitlines()]
        return [r for r in self._cache[(run, fname)] if r["prompt_sha256"] == sha]


@dataclass
class HiddenStateIndex:
    """token-ids sha256 -> (run, manifest, sample entry) of committed samples with the same settings."""

    where: dict[str, tuple[str, ExtractManifest, SampleEntry]] = field(default_factory=dict)

    @classmethod
    def build(cls, store: Store, recipe: Recipe, run_id: str) -> "HiddenStateIndex":
        from eagle_jobs.stream import consumed

        idx = cls()
        gone: dict[str, set[str]] = {}  # per run: consumed shards whose data re-extract mode deleted
        for run, m in matching_manifests(store, run_id, StageName.EXTRACT.dir, extract_digest(recipe)):
            if run not in gone:  # three listings a run, no request per shard (50,000 at the Kimi recipe)
                gone[run] = consumed(store, run) - Stage(store, run, StageName.EXTRACT.dir).committed_names()
            if m["shard"] in gone[run]:
                continue  # re-extract mode deleted its data: the manifest stays, the states do not
            for e in m["samples"]:
                if "ids_sha256" in e:
                    idx.where.setdefault(e["ids_sha256"], (run, m, e))
        return idx


def reuse_plan(store: Store, recipe: Recipe, run_id: str, convs, rows: list[dict] | None = None) -> dict:
    """What `capture` and `extract` would take from other runs instead of computing."""
    cap = CaptureIndex.build(store, recipe, run_id)
    reused = [c for c in convs if c.sha in cap.where]
    tokens = 0
    hs = HiddenStateIndex.build(store, recipe, run_id)
    for c in reused:
        for r in cap.rows_for(c.sha) or []:
            if ids_sha256(r["input_ids"]) in hs.where:
                tokens += len(r["input_ids"])
    return {"conversations": len(convs), "capture_reused": len(reused),
            "from_runs": sorted({cap.where[c.sha][0] for c in reused}), "hidden_state_tokens_reused": tokens}
