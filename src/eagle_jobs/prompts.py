"""Prompt sets: JSONL or Parquet rows of OpenAI-style `messages`.

Sources: a local path, a store URI (file://, s3://), a Hugging Face dataset id
(hf://org/name), or bundled://<name> for the prompt sets shipped in this package.
Each conversation is validated before any model loads; the first bad row stops
the stage with its file and line.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import PromptSpec

ROLES = {"system", "user", "assistant", "tool", "developer"}


@dataclass(frozen=True)
class Conversation:
    index: int  # position in the prompt set (after `limit`)
    messages: tuple  # the turns as given (dicts with role/content)
    sha: str  # content address of the messages
    split: str  # "train" or "validation"

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


def _validate(obj: object, where: str) -> list[dict]:
    if not isinstance(obj, dict) or "messages" not in obj:
        raise BadInput(f"{where}: expected an object with a 'messages' list")
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise BadInput(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise BadInput(f"{where}: messages[{i}] has no 'role'")
        if m["role"] not in ROLES:
            raise BadInput(f"{where}: messages[{i}] has unknown role '{m['role']}' (use one of {sorted(ROLES)})")
        if not isinstance(m.get("content", ""), str | list | None):
            raise BadInput(f"{where}: messages[{i}].content must be a string")
    if not any(m["role"] == "user" for m in msgs):
        raise BadInput(f"{where}: conversation has no user turn")
    return [{"role": m["role"], "content": m.get("content") or ""} for m in msgs]


def _read_bytes(source: str) -> tuple[bytes, str]:
    if source.startswith("bundled://"):
        name = source.removeprefix("bundled://")
        ref = resources.files("eagle_jobs") / "data" / f"{name}.jsonl"
        if not ref.is_file():
            raise BadInput(f"prompts {source}: no bundled prompt set '{name}'")
        return ref.read_bytes(), f"{name}.jsonl"
    if source.startswith(("s3://", "file://")):
        from eagle_jobs.store import Store

        parent, _, name = source.rpartition("/")
        store = Store.open(parent)
        store.check()
        try:
            return store.get(name), name
        except FileNotFoundError:
            raise BadInput(f"prompts {source}: no such object") from None
    p = Path(source)
    if not p.is_file():
        raise BadInput(f"prompts {source}: no such file (prompts.source in the recipe)")
    return p.read_bytes(), p.name


def _rows(source: str, spec: PromptSpec) -> list[tuple[object, str]]:
    if source.startswith("hf://"):
        import datasets

        ds = datasets.load_dataset(source.removeprefix("hf://"), split=spec.hf_split)
        return [(dict(r), f"{source}[{i}]") for i, r in enumerate(ds)]
    data, name = _read_bytes(source)
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data))
        return [(r, f"{source} row {i}") for i, r in enumerate(table.to_pylist())]
    rows = []
    for ln, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        where = f"{source} line {ln}"
        if not line.strip():
            raise BadInput(f"{where}: empty line (remove it; each line must be one JSON conversation)")
        try:
            rows.append((json.loads(line), where))
        except json.JSONDecodeError as e:
            raise BadInput(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    return rows


def _is_validation(sha: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:{sha}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def load_prompts(spec: PromptSpec) -> list[Conversation]:
    rows = _rows(spec.source, spec)
    if spec.limit is not None:
        rows = rows[: spec.limit]
    convs = []
    for i, (obj, where) in enumerate(rows):
        msgs = _validate(obj, where)
        sha = hashlib.sha256(json.dumps(msgs, sort_keys=True).encode()).hexdigest()
        convs.append((i, tuple(msgs), sha))
    if not convs:
        raise BadInput(f"prompts {spec.source}: no usable prompt")
    # Validation split: a count takes the conversations with the smallest hashes;
    # a fraction takes each conversation by the hash of its content alone, so a
    # conversation keeps its split in any prompt set that contains it (no leakage
    # between a set and its supersets). Both are independent of sharding.
    if spec.validation >= 1:
        n_val = min(int(spec.validation), len(convs) - 1)
        ranked = sorted(convs, key=lambda c: hashlib.sha256(f"{spec.seed}:{c[2]}:{c[0]}".encode()).digest())
        val = {c[0] for c in ranked[:n_val]}
    else:
        val = {c[0] for c in convs if _is_validation(c[2], spec.seed, spec.validation)}
    return [Conversation(i, m, s, "validation" if i in val else "train") for i, m, s in convs]
