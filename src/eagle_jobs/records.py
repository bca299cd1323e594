"""The typed records stages exchange through the store (docs/FORMAT.md, checked by tests/test_format_doc.py).

The bytes on the store stay JSON (never pickle); these types say what a reader gets back, so a key
that one stage writes and another reads is spelled, and checked, in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, TypedDict

if TYPE_CHECKING:
    import torch

Split = Literal["train", "validation"]


class Row(TypedDict):
    """One training row: a line of capture's `data/<shard>.jsonl`."""

    row_id: str
    prompt_index: int
    prompt_sha256: str
    turn: int
    split: Split
    input_ids: list[int]
    loss_mask: list[int]
    num_prompt_tokens: int
    num_completion_tokens: int
    finish_reason: str
    reasoning: str | None
    content: str


class TensorEntry(TypedDict):
    dtype: str
    shape: list[int]
    offset: int


class SampleEntry(TypedDict):
    """One sample in an extract manifest's `samples`: where its bytes are, for one range read."""

    row_id: str
    split: Split
    prompt_index: int
    num_tokens: int
    loss_tokens: int
    ids_sha256: str
    start: int
    length: int
    tensors: dict[str, TensorEntry]


class Skipped(TypedDict):
    row_id: str
    reason: str


class RowStates(NamedTuple):
    """One row's hidden states as a backend computed them: [T, L, H] and the token ids they are for."""

    hidden_states: torch.Tensor
    token_ids: list[int]


class Extracted(NamedTuple):
    """What an extraction backend returns for a batch of rows: states per row id, and the rows it could
    not use with the reason (never a string where a tensor belongs)."""

    states: dict[str, RowStates]
    problems: dict[str, str]


class Advance(Protocol):
    def __call__(self, rows: int, tokens: int) -> None: ...


class HiddenStateBackend(Protocol):
    """An extraction backend: transformers hooks in this process, or a vLLM server's extract_hidden_states."""

    def states(self, rows: list[Row], advance: Advance) -> Extracted: ...

    def close(self) -> None: ...
