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

    manifests: list[dict]  # the extraction's shard manifests (none yet when streamed)
    layer_ids: list[int]  # the stored layers: the aux layers, then the last one
    hidden_size: int
    storage: str  # bfloat16 or fp8 (eagle_jobs.hsformat)
    rows: NotRequired[list[RowRef]]  # streamed: the capture rows, read once (committed.row_index)


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


# --- reports: eval's `data/report.json` and compare's (docs/FORMAT.md "eval", "variants and compare") ---


class TimedPass(TypedDict):
    """One timed pass of a set's requests on one server: output tokens/s and time to first token."""

    requests: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    ttft_s_mean: float
    ttft_s_p50: float
    ttft_s_max: float
    acceptance_length: float | None  # τ over this pass's requests (/metrics counters); None without a draft


class SpeedLevel(TypedDict):
    """One (k, concurrency) cell: the same requests with the draft at k and without a draft."""

    k: int
    concurrency: int
    requests: int
    with_draft: TimedPass
    without_draft: TimedPass
    speedup: float


class SpeedTable(TypedDict):
    """A set's speed: the same requests with and without the draft, per draft length and concurrency."""

    max_tokens: int
    levels: list[SpeedLevel]  # at evaluate.k, the k τ is measured at
    surface: list[SpeedLevel]  # every k of evaluate.num_speculative_tokens at every level


class PositionBucket(TypedDict):
    """Verify steps that start at output positions [start, end): their τ (accepted + 1, mean)."""

    start: int
    end: int
    verify_steps: int
    acceptance_length: float


class LevelChoice(TypedDict):
    """One measured concurrency level: the k with the highest speedup there (0: no k reaches 1.0x)."""

    concurrency: int
    k: int
    best_k: int  # the fastest k, paying or not
    speedup: float  # best_k's: the geometric mean over the timed prompt sets


class ServingRange(TypedDict):
    """Batch sizes [first, last] (last None: and above) and the k to serve them with (0: no draft)."""

    first: int
    last: int | None
    k: int


class ServingAdvice(TypedDict):
    """The config to deploy, from the speedup surface (eagle_jobs/deploy.py)."""

    by_level: list[LevelChoice]
    ranges: list[ServingRange]
    no_gain_from: int | None  # the batch size from which no draft is served; None: it pays at the top level
    speculative_config: dict | None  # None: speculation pays at no measured level
    command: list[str]  # `vllm serve` as evaluate measured it, the draft at DRAFT_PLACEHOLDER
    env: dict[str, str]  # what the measured server's environment adds
    note: str


class PromptSetResult(TypedDict):
    """One prompt set of an evaluation: served τ, the untrained draft's, and the speedup."""

    source: str
    num_prompts: int
    skipped_too_long: int
    acceptance_length: float
    per_position_acceptance: list[float]
    baseline_acceptance_length: float | None
    baseline_per_position_acceptance: list[float] | None
    tokens_generated: int
    verifier_forwards: int
    prompts_sha256: str
    speedup: SpeedTable | None
    max_new_tokens: int
    by_position: list[PositionBucket] | None  # None: the server gave no per-request steps


class EngineRecord(TypedDict):
    """What measured a τ and a speedup (evaluate.engine.engine_record): two figures compare only under one `key`."""

    engine: str  # vllm | transformers
    version: str  # the server's /version, or transformers' and torch's
    model_runner: str
    attention_backend: str
    spec_method: str
    spec_settings: dict  # num_speculative_tokens and the rejection rule in effect
    sampling: dict  # the request's sampling fields
    key: str  # content hash of every field above


class EvalReport(TypedDict):
    """eval's `data/report.json`: the first prompt set's figures at the top, every set in prompt_sets."""

    acceptance_length: float
    per_position_acceptance: list[float]
    num_speculative_tokens: int
    num_prompts: int
    tokens_generated: int
    verifier_forwards: int
    verifier: str
    draft: str
    baseline_acceptance_length: float | None
    baseline_per_position_acceptance: list[float] | None
    baseline_note: str
    speedup: SpeedTable | None
    speedup_note: str
    speedup_wall_s: float | None
    speed_ks: list[int]
    concurrency_levels: list[int]
    position_bucket_tokens: int
    trained_answer_tokens: int  # sampling.max_new_tokens: the longest answer the draft was trained on
    serving: ServingAdvice | None
    min_speedup: float | None
    teacher_forced_estimate: float | None
    teacher_forced_note: str
    backend: str
    engine: EngineRecord
    prompts: str
    prompts_sha256: str
    prompt_sets: dict[str, PromptSetResult]
    train: dict
    run_id: str


class ArmSetResult(TypedDict):
    """One prompt set of one compared arm: the subset of its PromptSetResult the table shows."""

    acceptance_length: float
    per_position_acceptance: list[float]
    num_prompts: int
    baseline_acceptance_length: float | None
    speedup: SpeedTable | None
    prompts_sha256: str


class CompareArm(TypedDict):
    variant: str
    overrides: dict
    prompt_sets: dict[str, ArmSetResult]
    train_seconds: float | None
    epochs: int | None
    selection: dict | None
    teacher_forced_estimate: float | None


class CompareReport(TypedDict):
    """compare's `data/report.json`: every arm with a committed evaluation, in recipe order."""

    run_id: str
    recipe: str
    variants: list[CompareArm]
    missing: list[str]
