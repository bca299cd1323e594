"""The typed records stages exchange through the store (docs/FORMAT.md, checked by tests/test_format_doc.py).

The bytes on the store stay JSON (never pickle); these types say what a reader gets back, so a key
that one stage writes and another reads is spelled, and checked, in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple, NotRequired, Protocol, TypedDict

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


class RowRef(NamedTuple):
    """What planning needs of one capture row, and where its bytes are: never its tokens.

    A pod keeps one of these per row of the corpus (about 0.3 KB in Python: `benchmarks/scale`), and
    reads a row's tokens (`load_rows`) only for the shard it is working on, so its memory follows its
    shard, not the corpus (52 bytes per token as Row objects: 74 GiB at the Kimi recipe's 600 k rows)."""

    row_id: str
    split: Split
    num_tokens: int
    loss_tokens: int
    shard: str  # the capture shard: data/<shard>.jsonl
    start: int  # the row's line in it: bytes [start, start + length)
    length: int


class ExtractionInfo(TypedDict):
    """What train and evaluate know of an extraction: committed.extraction_info reads it from the committed
    shards; a streamed trainer (train.source stream) builds it from the recipe while extraction runs."""

    manifests: list[ExtractManifest]  # the extraction's shard manifests (none yet when streamed)
    layer_ids: list[int]  # the stored layers: the aux layers, then the last one
    hidden_size: int
    storage: str  # bfloat16 or fp8 (eagle_jobs.hsformat)
    rows: NotRequired[list[RowRef]]  # streamed: the capture rows, read once (committed.row_index)


# --- manifests: what Stage.commit_shard writes, the commit (docs/FORMAT.md "Commit protocol") ---


class FileEntry(TypedDict):
    size: int
    sha256: str


class Manifest(TypedDict):
    """Every shard's manifest: where and what its objects are. A stage's own fields come on top
    (its `...Fields`), written by that stage alone and read through its typed reader."""

    shard: str
    stage: str
    run_id: str
    files: dict[str, FileEntry]
    committed_at: float


class CaptureFields(TypedDict):
    """capture's manifest fields (docs/FORMAT.md "capture", manifest extras)."""

    rows: int
    tokens: int
    row_index: NotRequired[list[list]]  # [row_id, split, num_tokens, loss_tokens, start, length] a line
    prompt_indices: list[int]
    prompt_sha256s: list[str]
    skipped_too_long: list[str]  # "<prompt_index>:<turn>"
    reused_conversations: int
    settings_digest: str
    verifier: str
    backend: str
    sampling: dict  # the effective sampling parameters (eagle_jobs.sampling.effective)


class CaptureManifest(Manifest, CaptureFields):
    pass


class ExtractFields(TypedDict):
    """extract's manifest fields (docs/FORMAT.md "extract"): the index a reader range-reads samples by."""

    format: str
    storage: str  # bfloat16 | fp8
    layer_ids: list[int]
    hidden_size: int
    samples: list[SampleEntry]
    skipped: list[Skipped]
    verifier: str
    tokens: int
    settings_digest: str


class ExtractManifest(Manifest, ExtractFields):
    pass


class CheckpointFields(TypedDict):
    """train's checkpoint and final/ manifest fields (docs/FORMAT.md "train")."""

    epoch: int
    local_step: NotRequired[int]  # a checkpoint's: 0 the epoch's end, else the steps of the epoch done
    recipe_digest: NotRequired[str]  # a checkpoint's: what a resume must match (Recipe.train_digest)
    selected_by: NotRequired[str]  # final/'s, once `train.select_by: served` chose it


class CheckpointManifest(Manifest, CheckpointFields):
    pass


class StagePlan(TypedDict):
    """One stage of `eagle-jobs plan`: its time at the recipe's stated rates, store objects and bytes, and the
    activeDeadlineSeconds it needs at least (plan.deadline_floor_s)."""

    time_s: float
    objects: int
    write_bytes: float
    read_bytes: float
    deadline_floor_s: int


class Plan(TypedDict):
    """`eagle-jobs plan --json`: what a recipe costs (eagle_jobs.plan.make_plan); `reuse` with --store."""

    conversations: int
    samples: int
    tokens: int
    tokens_per_sample: float  # mean prompt tokens plus max_new_tokens, within limits.max_seq_len
    hidden_state_bytes: dict[str, int]  # the corpus's hidden states in bfloat16 and in fp8
    stored_layers: int
    storage: str  # what extract.storage_dtype resolves to for this corpus
    draft_shape: str
    draft_parameters: dict[str, int]  # trainable, total, saved
    gpus_for_training: int
    train_checkpoint: dict[str, float]  # bytes, save_s
    untrained_draft_bytes: int  # the peak of building evaluate's untrained draft
    stages: dict[str, StagePlan]
    total_time_s: float
    total_objects: int
    reuse: NotRequired[dict]


class Advance(Protocol):
    def __call__(self, rows: int, tokens: int) -> None: ...


class HiddenStateBackend(Protocol):
    """An extraction backend: transformers hooks in this process, or a vLLM server's extract_hidden_states."""

    def states(self, rows: list[Row], advance: Advance) -> Extracted: ...

    def close(self) -> None: ...


# train's record (records/train.py) and the reports (eval, compare: records/reports.py), one name here as
# everywhere else
from eagle_jobs.records.reports import (  # noqa: E402, F401
    ArmSetResult,
    CompareArm,
    CompareReport,
    EngineRecord,
    EvalReport,
    LevelChoice,
    PositionBucket,
    PromptSetResult,
    ServingAdvice,
    ServingRange,
    SpeedLevel,
    SpeedTable,
    TimedPass,
    TrainSummary,
)
from eagle_jobs.records.train import Selection, TrainRecord  # noqa: E402, F401
