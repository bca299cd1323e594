"""`eagle-jobs prompts build`: the prompt set a real run reads, mixed from the conversation data sets the
anchors train on, deduplicated, in one streamed pass.

Every source is read by eagle_jobs.prompts (ShareGPT `conversations`, OpenAI/HF chat `messages` as
UltraChat and most HF chat sets ship them, Open-PerfectBlend's ShareGPT rows; JSONL, JSON arrays, Parquet,
pypi:// and hf:// sets), so a row the mix takes is a row capture accepts. The mix:
- takes each source's share of `size` by weight (default equal), rounded so the shares sum to `size`;
- drops a conversation whose messages (as capture hashes them, prompts.content_hash) an earlier row of any
  source already had, and rows capture would reject, each counted by reason;
- fills a source's shortfall (a small source, many duplicates) from the others, in order;
- interleaves the sources by weight (a smooth weighted round-robin), so any prefix of the file, as
  `prompts.limit` takes it, is the same mix;
- writes OpenAI `messages` JSONL, then the manifest `<out>.manifest.json` (sources, counts, rejects, the
  file's sha256): a store object appears whole or not at all (Store.put_file), and the manifest last.

Memory: one 16-byte digest per kept conversation (about 80 B in a Python set: 80 MB at a million) and a
read buffer per source; the output is written to local disk as it goes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle_jobs.errors import BadInput
from eagle_jobs.layout import content_hash
from eagle_jobs.progress import console
from eagle_jobs.prompt_rows import BadRow, row_messages
from eagle_jobs.prompts import Rejects, source_rows
from eagle_jobs.recipe import PromptSpec


@dataclass
class MixSource:
    """One source of the mix: its URI or path, its weight, and what was read of it."""

    uri: str
    weight: float = 1.0
    quota: int = 0
    taken: int = 0
    duplicates: int = 0
    read: int = 0
    rejects: Rejects = field(init=False)
    exhausted: bool = False

    def __post_init__(self) -> None:
        self.rejects = Rejects(self.uri)

    def to_json(self) -> dict:
        return {"source": self.uri, "weight": self.weight, "quota": self.quota, "taken": self.taken,
                "rows_read": self.read, "duplicates": self.duplicates, "rejected": self.rejects.rejected,
                "rejected_by_reason": dict(self.rejects.by_reason),
                "rejected_first": self.rejects.rows_rejected[:20], "note": self.rejects.note}


def parse_source(text: str) -> MixSource:
    """`<uri>` or `<uri>=<weight>`: the weight after the last '=' when it is a positive number."""
    uri, sep, w = text.rpartition("=")
    if sep:
        try:
            weight = float(w)
        except ValueError:
            return MixSource(text)
        if weight <= 0:
            raise BadInput(f"prompts build: --source {text}: a weight must be above 0")
        return MixSource(uri, weight)
    return MixSource(text)


def quotas(sources: list[MixSource], size: int) -> None:
    """Each source's share of `size` by weight, largest remainders first, summing to `size`."""
    total = sum(s.weight for s in sources)
    exact = [size * s.weight / total for s in sources]
    for s, e in zip(sources, exact):
        s.quota = int(e)
    left = size - sum(s.quota for s in sources)
    for i in sorted(range(len(sources)), key=lambda i: exact[i] - int(exact[i]), reverse=True)[:left]:
        sources[i].quota += 1


def _conversations(src: MixSource, seen: set[bytes]) -> Iterator[list[dict]]:
    """The source's new, valid conversations as OpenAI messages, counting what is skipped and why."""
    spec = PromptSpec(source=src.uri, validation=0)
    for obj, where, _span in source_rows(src.uri, spec, src.rejects):
        src.read += 1
        src.rejects.rows += 1
        if obj is None:
            continue
        try:
            msgs = row_messages(obj)
        except BadRow as e:
            src.rejects.add(where, e.reason, str(e))
            continue
        digest = bytes.fromhex(content_hash(msgs, 32))
        if digest in seen:
            src.duplicates += 1
            continue
        seen.add(digest)
        yield msgs
    src.exhausted = True


def _interleave(sources: list[MixSource], streams: list[Iterator[list[dict]]], size: int) -> Iterator[list[dict]]:
    """Up to `size` conversations: each source to its quota, interleaved by weight; then the shortfall
    from the sources that still have rows, in order."""
    credit = [0.0] * len(sources)
    active = [i for i, s in enumerate(sources) if s.quota > 0]
    total = sum(sources[i].weight for i in active)
    out = 0
    while active and out < size:
        for i in active:
            credit[i] += sources[i].weight
        i = max(active, key=lambda j: credit[j])
        credit[i] -= total
        msgs = next(streams[i], None)
        if msgs is None or sources[i].taken + 1 >= sources[i].quota:
            active.remove(i)
            total = sum(sources[j].weight for j in active)
        if msgs is not None:
            sources[i].taken += 1
            out += 1
            yield msgs
    for i, s in enumerate(sources):
        while out < size and not s.exhausted:
            msgs = next(streams[i], None)
            if msgs is None:
                break
            s.taken += 1
            out += 1
            yield msgs


def build_mix(sources: list[MixSource], size: int, out: str) -> dict:
    """Write the mix to `out` (a path or a store URI) and its manifest beside it; the manifest."""
    if size < 1:
        raise BadInput(f"prompts build: --size {size}: need at least 1 conversation")
    if not sources:
        raise BadInput("prompts build: no --source given: name one or more prompt sets (JSONL, JSON, Parquet, "
                       "pypi://, hf://)")
    quotas(sources, size)
    seen: set[bytes] = set()
    streams = [_conversations(s, seen) for s in sources]
    sha = hashlib.sha256()
    written = 0
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
        tmp = Path(f.name)
        for msgs in _interleave(sources, streams, size):
            line = (json.dumps({"messages": msgs}, ensure_ascii=False) + "\n").encode()
            f.write(line)
            sha.update(line)
            written += 1
            if written % 100_000 == 0:
                console.print(f"  prompts build: {written:,} of {size:,} conversations", markup=False)
    try:
        if written < size:
            raise BadInput(f"prompts build: the sources hold {written:,} new, valid conversations, fewer than "
                           f"--size {size:,}: add a source or lower --size (nothing written)")
        manifest = {"format": "eagle-jobs/prompt-mix/v1", "out": out, "conversations": written,
                    "sha256": sha.hexdigest(), "sources": [s.to_json() for s in sources]}
        _publish(tmp, out, manifest)
    finally:
        tmp.unlink(missing_ok=True)
    return manifest


def _publish(tmp: Path, out: str, manifest: dict) -> None:
    """The file whole first (a store object appears only when its upload completes; a local file by rename),
    then its manifest: a manifest always names a complete file."""
    body = json.dumps(manifest, indent=1).encode()
    if out.startswith(("s3://", "file://")):
        from eagle_jobs.store import Store

        parent, _, name = out.rpartition("/")
        store = Store.open(parent)
        store.check()
        store.put_file(name, tmp)
        store.put(f"{name}.manifest.json", body)
        return
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    shutil.copyfile(tmp, part)
    part.replace(dest)
    mpart = dest.with_name(dest.name + ".manifest.json.part")
    mpart.write_bytes(body)
    mpart.replace(dest.with_name(dest.name + ".manifest.json"))

