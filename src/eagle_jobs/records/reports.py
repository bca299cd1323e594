"""The reports' typed records: eval's `data/report.json` and compare's (docs/FORMAT.md "eval", "variants and
compare", field by field: tests/test_format_doc.py). Imported through eagle_jobs.records."""

from __future__ import annotations

from typing import TypedDict

from eagle_jobs.records.train import Selection


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


class TrainSummary(TypedDict):
    """What eval's report repeats of the train record it evaluated (None: the record has no such field)."""

    samples: dict[str, int] | None
    epochs: int | None
    total_steps: int | None
    parameters: dict[str, int] | None
    selection: Selection | None


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
    train: TrainSummary
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
