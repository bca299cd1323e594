"""The artifact store every stage reads and writes: file:// or s3:// through fsspec (what only S3 needs:
store_s3.py).

Layout (docs/FORMAT.md): <store>/<run-id>/<stage>/
    data/<shard>.<ext>         shard objects
    manifests/<shard>.json     written after its data: size and sha256 of each object
    workers/<i>-of-<n>.json    worker i of n has committed all of its shards
    COMPLETE.json              the stage is complete (written once every worker is done)

A shard without a manifest does not exist for readers; a rerun skips shards
whose manifest verifies and redoes the rest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import fsspec

from eagle_jobs.errors import StoreError
from eagle_jobs.records import FileEntry, Manifest
from eagle_jobs.store_s3 import (
    MULTIPART_THRESHOLD,
    RETRIES,
    check_bucket,
    fatal,
    is_transient,
    multipart_upload,
    s3_filesystem,
)

T = TypeVar("T")

GET_BATCH = 256  # objects read concurrently by Store.get_many
MANY_MANIFESTS = 2000  # Stage.manifests says when it reads this many


def nearby_runs(items: Sequence[T], span: Callable[[T], tuple[int, int]], max_gap: int) -> Iterator[list[T]]:
    """`items` sorted by start and cut into runs whose neighbours are at most `max_gap` bytes apart (span:
    (start, length)): a run is one range read of the bytes from its first start to its last end."""
    ordered = sorted(items, key=lambda x: span(x)[0])
    run: list[T] = []
    for x in ordered:
        if run and span(x)[0] - sum(span(run[-1])) > max_gap:
            yield run
            run = []
        run.append(x)
    if run:
        yield run


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Store:
    """One store root: a protocol, a filesystem and a root path inside it."""

    uri: str
    fs: Any
    root: str

    @classmethod
    def open(cls, uri: str) -> "Store":
        if "://" not in uri:
            uri = "file://" + str(Path(uri).absolute())
        protocol, _, rest = uri.partition("://")
        if protocol == "file":
            root = str(Path(rest).absolute())
            fs = fsspec.filesystem("file", auto_mkdir=True)
        elif protocol == "s3":
            if not rest.strip("/"):
                raise StoreError(f"store {uri}: no bucket in the URI (use s3://<bucket>/<prefix>)")
            fs, root = s3_filesystem(), rest.rstrip("/")
        else:
            raise StoreError(f"store {uri}: unsupported scheme '{protocol}' (use file:// or s3://)")
        return cls(uri=uri.rstrip("/"), fs=fs, root=root)

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    def path(self, key: str) -> str:
        return f"{self.root}/{key.lstrip('/')}"

    def url(self, key: str) -> str:
        return f"{self.uri}/{key.lstrip('/')}"

    # -- retries --------------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = 0.2
        for attempt in range(RETRIES + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if not is_transient(e):
                    raise fatal(self.uri, what, e) from None
                if attempt == RETRIES:
                    raise StoreError(f"store {self.uri}: {what} still failing after {RETRIES} retries: {e}") from None
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def check(self) -> None:
        """Fail at once, with one line, when the store cannot be used at all."""
        if not self.is_s3:
            Path(self.root).mkdir(parents=True, exist_ok=True)
            return
        check_bucket(self.fs, self.uri, self.root.split("/", 1)[0], self._retry)

    # -- objects --------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        """Write one object whole: readers see all of it or nothing."""
        p = self.path(key)
        if not self.is_s3:
            tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
            Path(p).parent.mkdir(parents=True, exist_ok=True)
            try:  # out of disk mid-write: no *.tmp-* left beside the objects
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            finally:
                Path(tmp).unlink(missing_ok=True)
            return
        if len(data) > MULTIPART_THRESHOLD:
            self._retry(f"multipart upload of {key}", lambda: multipart_upload(self.fs, p, data))
        else:
            self._retry(f"upload of {key}", lambda: self.fs.pipe_file(p, data))

    def put_file(self, key: str, local: str | Path) -> None:
        """Upload a local file without holding it in memory (a verifier shard is several GB).

        S3 makes the object visible only when the (multipart) upload completes; on file:// a
        temporary name is renamed, so readers see all of it or nothing either way.
        """
        p = self.path(key)
        if not self.is_s3:
            tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
            Path(p).parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(local, tmp)
                os.replace(tmp, p)
            finally:
                Path(tmp).unlink(missing_ok=True)
            return
        self._retry(f"upload of {key}", lambda: self.fs.put_file(str(local), p))

    def get_file(self, key: str, local: str | Path) -> None:
        """Download an object to a local file, streamed, renamed into place when whole."""
        tmp = Path(f"{local}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._retry(f"download of {key}", lambda: self.fs.get_file(self.path(key), str(tmp)))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object, or the byte range [start, end) of it."""
        p = self.path(key)
        return self._retry(f"read of {key}", lambda: self.fs.cat_file(p, start=start, end=end))

    def exists(self, key: str) -> bool:
        p = self.path(key)
        return self._retry(f"stat of {key}", lambda: self.fs.exists(p))

    def size(self, key: str) -> int:
        p = self.path(key)
        return int(self._retry(f"stat of {key}", lambda: self.fs.size(p)))

    def list(self, prefix: str) -> list[str]:
        """Keys (relative to the root) of the objects directly under prefix/."""
        p = self.path(prefix).rstrip("/")
        if self.is_s3:
            self.fs.invalidate_cache(p)
        try:
            entries = self._retry(f"listing of {prefix}", lambda: self.fs.ls(p, detail=False))
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            rel = e[len(self.root) + 1 :] if e.startswith(self.root + "/") else e
            if ".tmp-" not in rel:
                out.append(rel)
        return sorted(out)

    def get_many(self, keys: Sequence[str], on_batch: Callable[[int], None] | None = None) -> dict[str, bytes]:
        """Several whole objects, read GET_BATCH at a time concurrently (s3fs's async `cat`), not one
        request after another: a stage that reads every manifest of a run (thousands at the recipe's
        scale) before its first heartbeat reads them in seconds. `on_batch(done)` after each batch (a
        heartbeat). A key that is gone by the time it is read is left out; one that failed otherwise is
        read again on its own, with `get`'s retries."""
        out: dict[str, bytes] = {}
        for i in range(0, len(keys), GET_BATCH):
            part = {self.path(k): k for k in keys[i : i + GET_BATCH]}
            got = self.fs.cat(list(part.keys()), on_error="return")
            for p, data in got.items():
                if isinstance(data, FileNotFoundError):
                    continue
                try:
                    out[part[p]] = self.get(part[p]) if isinstance(data, BaseException) else data
                except FileNotFoundError:
                    continue
            if on_batch is not None:
                on_batch(min(len(keys), i + GET_BATCH))
        return out

    def put_many(self, objects: dict[str, bytes]) -> None:
        """Small objects, each written whole, GET_BATCH at a time concurrently on S3 (s3fs's async `pipe`):
        training marks a checkpoint's thousands of consumed shards in seconds, not one request after another."""
        if not self.is_s3:
            for k, v in objects.items():
                self.put(k, v)
            return
        items = list(objects.items())
        for i in range(0, len(items), GET_BATCH):
            part = {self.path(k): v for k, v in items[i : i + GET_BATCH]}
            self._retry(f"upload of {len(part)} objects under {items[i][0].rsplit('/', 1)[0]}",
                        functools.partial(self.fs.pipe, part))

    def delete_many(self, keys: Sequence[str]) -> None:
        """Objects deleted in S3's bulk requests (s3fs: up to 1,000 keys a request); missing keys are fine."""
        if not keys:
            return
        if not self.is_s3:
            for k in keys:
                self.delete(k)
            return
        paths = [self.path(k) for k in keys]
        try:
            self._retry(f"delete of {len(paths)} objects", lambda: self.fs.rm(paths))
        except FileNotFoundError:
            pass

    def delete(self, key: str) -> None:
        p = self.path(key)
        try:
            self._retry(f"delete of {key}", lambda: self.fs.rm(p, recursive=True))
        except FileNotFoundError:
            pass

    @staticmethod
    def json_bytes(obj: Any) -> bytes:
        """How every JSON object on the store is written."""
        return json.dumps(obj, indent=1, sort_keys=True).encode()

    def put_json(self, key: str, obj: Any) -> None:
        self.put(key, self.json_bytes(obj))

    def get_json(self, key: str) -> Any:
        return json.loads(self.get(key))


class Stage:
    """The commit protocol of one stage of one run."""

    def __init__(self, store: Store, run_id: str, name: str):
        self.store, self.run_id, self.name = store, run_id, name
        self.prefix = f"{run_id}/{name}"

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    # shards ---------------------------------------------------------------------
    def commit_shard(self, shard: str, objects: dict[str, bytes], meta: Mapping[str, Any]) -> Manifest:
        """Write the shard's objects, then its manifest: the manifest is the commit."""
        files: dict[str, FileEntry] = {}
        for fname, data in objects.items():
            self.store.put(self.key(f"data/{fname}"), data)
            files[fname] = {"size": len(data), "sha256": sha256(data)}
        manifest = cast(Manifest, {"shard": shard, "stage": self.name, "run_id": self.run_id, "files": files,
                                   "committed_at": time.time(), **meta})
        self.store.put_json(self.key(f"manifests/{shard}.json"), manifest)
        return manifest

    def manifest(self, shard: str) -> Manifest | None:
        try:
            return self.store.get_json(self.key(f"manifests/{shard}.json"))
        except FileNotFoundError:
            return None

    def is_committed(self, shard: str) -> bool:
        """A shard counts once its manifest exists and its objects have the stated sizes."""
        m = self.manifest(shard)
        if m is None:
            return False
        try:
            return all(self.store.size(self.key(f"data/{f}")) == v["size"] for f, v in m["files"].items())
        except FileNotFoundError:
            return False

    def manifest_names(self) -> list[str]:
        """The committed shards' names, from one listing."""
        return [k.rsplit("/", 1)[1].removesuffix(".json") for k in self.store.list(self.key("manifests"))
                if k.endswith(".json")]

    def manifests(self, names: list[str] | None = None) -> list[Manifest]:
        """The manifests of `names` (default: every committed shard), read concurrently; the stage's
        heartbeat beats between batches, so a worker reading a whole run's manifests stays alive."""
        from eagle_jobs.heartbeat import beat

        names = self.manifest_names() if names is None else names
        if len(names) >= MANY_MANIFESTS:
            from eagle_jobs.progress import console

            console.print(f"  reading {len(names):,} manifests of {self.store.url(self.prefix)}", markup=False)
        got = self.store.get_many([self.key(f"manifests/{n}.json") for n in names], on_batch=lambda _n: beat())
        return sorted((json.loads(v) for v in got.values()), key=lambda m: m["shard"])

    def committed_names(self) -> set[str]:
        """Shards with a manifest and a data object: two listings, no request per shard (a restarted
        extraction worker owns tens of thousands). Weaker than `is_committed`, which also checks each
        object's size against its manifest; the store writes every object whole (Store.put), so a data
        object exists whole or not at all."""
        data = {k.rsplit("/", 1)[1].split(".", 1)[0] for k in self.store.list(self.key("data"))}
        return {n for n in self.manifest_names() if n in data}

    def read(self, fname: str, verify: FileEntry | None = None) -> bytes:
        data = self.store.get(self.key(f"data/{fname}"))
        self._check(fname, data, verify)
        return data

    def read_many(self, files: Sequence[tuple[str, FileEntry]]) -> list[bytes]:
        """The data objects of `files` ((name, manifest file info) each), read together, each checked as `read`
        checks it."""
        got = self.store.get_many([self.key(f"data/{f}") for f, _ in files])
        out = []
        for fname, info in files:
            data = got.get(self.key(f"data/{fname}"))
            if data is None:
                raise StoreError(f"store {self.store.url(self.key('data/' + fname))}: missing, though its "
                                 "manifest is committed; rerun the stage")
            self._check(fname, data, info)
            out.append(data)
        return out

    def _check(self, fname: str, data: bytes, verify: FileEntry | None) -> None:
        if verify is not None and sha256(data) != verify["sha256"]:
            raise StoreError(f"store {self.store.url(self.key('data/' + fname))}: "
                             "sha256 mismatch with its manifest; rerun the stage")

    def iter_objects(self) -> Iterator[tuple[Manifest, str, bytes]]:
        for m in self.manifests():
            for fname, info in m["files"].items():
                yield m, fname, self.read(fname, info)

    # completion -----------------------------------------------------------------
    def mark_worker_done(self, index: int, num_workers: int, summary: dict) -> bool:
        """Record that this worker committed all its shards; complete the stage if it was the last."""
        self.store.put_json(self.key(f"workers/{index:05d}-of-{num_workers:05d}.json"), summary)
        done = [k for k in self.store.list(self.key("workers")) if k.endswith(f"-of-{num_workers:05d}.json")]
        if len(done) >= num_workers:
            self.complete({"num_workers": num_workers})
            return True
        return False

    def complete(self, info: dict) -> None:
        self.store.put_json(self.key("COMPLETE.json"), {"stage": self.name, "run_id": self.run_id,
                                                        "completed_at": time.time(), **info})

    def is_complete(self) -> bool:
        return self.store.exists(self.key("COMPLETE.json"))

    def completion(self) -> dict | None:
        try:
            return self.store.get_json(self.key("COMPLETE.json"))
        except FileNotFoundError:
            return None
