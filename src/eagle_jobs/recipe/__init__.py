"""The recipe: one typed file (jobs/*.yaml) describes one training run.

Every stage reads the same Recipe. Unknown keys and impossible values are
rejected when the file is loaded, before any model or server starts, with a
line that names the file and the key. Every setting carries its meaning in
`Field(description=...)`: docs/RECIPE.md is generated from this package
(`eagle-jobs recipe reference`), and a test keeps the two equal. The Recipe, its store, plan rates and
variants are here; its sections in sections.py (what a run starts from) and stages.py (what each stage does).
"""

from __future__ import annotations

import re

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from eagle_jobs.errors import BadInput
from eagle_jobs.layout import content_hash
from eagle_jobs.recipe.sections import (
    COMMIT,
    EMBEDDED_SMOLLM2,
    HUB_ID,
    ChatSpec,
    LimitSpec,
    PromptSpec,
    SamplingSpec,
    Section,
    StageBackend,
    VerifierSpec,
    VllmServerSpec,
    default_aux_layer_ids,
    default_backend,
    is_hub_id,
    vllm_installed,
)
from eagle_jobs.recipe.stages import (
    LONG_OUTPUT_SET,
    CaptureSpec,
    DraftSpec,
    EvaluateSpec,
    ExtractSpec,
    LongOutputSpec,
    LossName,
    LossSpec,
    MuonSpec,
    NormSpec,
    TrainSpec,
)

# train.source stream: the window holds at least this many shards (and steps' worth of states): see
# eagle_jobs/stream/__init__.py for the budget that keeps extraction and training from waiting on each other.
WINDOW_SHARDS = 8


class StoreSpec(Section):
    """Where a run's committed output lives."""

    uri: str = Field(default="file://./store", description=(
        "file://<dir> or s3://<bucket>[/<prefix>] (--store and $EAGLE_JOBS_STORE override it): runs live at "
        "<store>/<run id>/, and store:<key> references in this recipe resolve to <store>/<key>"))
    run_id: str = Field(default="default", description=(
        "the run's folder on the store (--run-id and $EAGLE_JOBS_RUN_ID override it)"))
    window_bytes: int | None = Field(default=None, gt=0, description=(
        "train.source stream: bytes of committed states training has not finished with, at most; extraction "
        "pauses at it (peak store use: the window plus one shard per extraction worker in flight)"))

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        from eagle_jobs.runid import run_id_problem  # the one rule (eagle_jobs/runid.py)

        if problem := run_id_problem(v):
            raise ValueError(f"run id {v!r} {problem}")
        return v


class Throughputs(Section):
    """Stated rates for `plan`: a vLLM rate is one server's (one pod on one node of `gpus_per_node` GPUs), the
    store rate one pod's. Each field's description says where its default comes from; `plan --scale` prints it
    beside the value (or says the recipe set it)."""

    capture_tokens_per_s: float = Field(default=2500.0, gt=0, description=(
        "answer tokens/s one vLLM server decodes; an estimate, not a measurement"))
    extract_tokens_per_s: float = Field(default=20000.0, gt=0, description=(
        "tokens/s one vLLM server prefills with extract_hidden_states (extraction is prefill only, so a re-extracted "
        "epoch runs at this rate too); an estimate, not a measurement"))
    train_samples_per_s_per_gpu: float = Field(default=0.5, gt=0, description=(
        "the seed run, Kimi-K2.5's draft trained by hand: 10 samples x 3 epochs in about a minute on one RTX PRO 6000"))
    eval_tokens_per_s: float = Field(default=300.0, gt=0, description=(
        "answer tokens/s of evaluation; an estimate, not a measurement"))
    store_bytes_per_s: float = Field(default=500e6, gt=0, description=(
        "bytes/s one pod writes to or reads from the store; an estimate, not a measurement"))
    gpus_per_node: int = Field(default=8, gt=0, description=(
        "GPUs of one capture, extract or train pod in k8s/overlays/full (docs/OPERATIONS.md#node-sizes)"))
    capture_nodes: int = Field(default=1, gt=0, description="capture pods in k8s/overlays/full")
    extract_nodes: int = Field(default=4, gt=0, description="extraction pods in k8s/overlays/full (completions 4)")
    # The window `plan --scale` prices streaming with when the recipe has no store.window_bytes.
    stream_window_bytes: int = Field(default=64 * 1024**3, gt=0, description=(
        "a choice, not a measurement: 32 shards of 512 MiB for each of the 4 extraction pods"))


class VariantSpec(Section):
    """One arm of `eagle-jobs compare`: overrides of the draft and training sections only, so every
    variant trains on the same committed extraction and is evaluated on the same prompts."""

    draft: dict = Field(default_factory=dict, description="keys of `draft` this arm changes")
    train: dict = Field(default_factory=dict, description="keys of `train` this arm changes")


VARIANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")
BASE_VARIANT = "base"  # the recipe as written, always one arm of a comparison


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Recipe(Section):
    """One training run: the verifier, its prompts, and each stage's settings. A recipe states only what
    differs from these defaults."""

    name: str = Field(description="the recipe's name")
    description: str = Field(default="", description="one line on what the run is")
    verifier: VerifierSpec = Field(description="the model the draft serves")
    prompts: PromptSpec = Field(description="the conversations")
    chat: ChatSpec = Field(default=ChatSpec(), description="the chat template and reasoning mode")
    sampling: SamplingSpec = Field(default=SamplingSpec(), description="how capture samples")
    limits: LimitSpec = Field(default=LimitSpec(), description="sequence lengths")
    aux_layer_ids: list[int] = Field(min_length=1, json_schema_extra={"derived": "2, n//2, n-3"}, description=(
        "verifier layers whose inputs feed the draft (HF hidden_states[k]; the final layer's pre-norm output is "
        "stored as well); unset: 2, n//2 and n-3 of the verifier's n layers (verifier.num_layers, else its config)"))
    capture: CaptureSpec = Field(default_factory=lambda: CaptureSpec.model_validate({}), description="stage 1")
    extract: ExtractSpec = Field(default_factory=lambda: ExtractSpec.model_validate({}), description="stage 2")
    draft: DraftSpec = Field(default=DraftSpec(), description="the draft's shape")
    train: TrainSpec = Field(default=TrainSpec(), description="stage 3")
    evaluate: EvaluateSpec = Field(default_factory=lambda: EvaluateSpec.model_validate({}), description="stage 4")
    store: StoreSpec = Field(default=StoreSpec(), description="where committed output lives")
    plan: Throughputs = Field(default=Throughputs(), description="stated rates `eagle-jobs plan` prices with")
    variants: dict[str, VariantSpec] = Field(default_factory=dict, description=(
        "`eagle-jobs compare`: name -> overrides of draft and train, e.g. {lk: {train: {loss: lk_hybrid}}}"))

    @model_validator(mode="before")
    @classmethod
    def _derived_aux(cls, data):
        """aux_layer_ids from verifier.num_layers when unset (load_recipe reads the count from the config
        when the recipe gives neither)."""
        if isinstance(data, dict) and data.get("aux_layer_ids") is None:
            verifier = data.get("verifier")
            try:
                spec = verifier if isinstance(verifier, VerifierSpec) else VerifierSpec.model_validate(verifier)
            except ValidationError:
                return data  # the verifier's own validation names the key
            if spec.num_layers is not None:
                data = {**data, "aux_layer_ids": default_aux_layer_ids(spec.num_layers)}
        return data

    def with_storage(self, dtype: str) -> "Recipe":
        """This recipe with extract.storage_dtype resolved (hsformat.resolve_storage): what extraction
        writes, records in its settings digest and matches reuse by."""
        return self.model_copy(update={"extract": self.extract.model_copy(update={"storage_dtype": dtype})})

    @model_validator(mode="after")
    def _variants_valid(self) -> "Recipe":
        for name in self.variants:
            if name == BASE_VARIANT or not VARIANT_NAME.match(name):
                raise ValueError(f"variants: '{name}' is not a variant name (lower-case letters, digits, - and _, "
                                 f"at most 31; '{BASE_VARIANT}' is the recipe itself)")
            self.variant(name)  # an override that makes an invalid recipe is refused at load
        return self

    def variant(self, name: str) -> "Recipe":
        """The recipe with variant `name`'s overrides applied (`base`: the recipe itself), no variants."""
        data = self.model_dump(mode="json")
        data["variants"] = {}
        if name != BASE_VARIANT:
            if name not in self.variants:
                raise BadInput(f"variant '{name}' is not in the recipe's variants: choose from "
                               f"{[BASE_VARIANT, *self.variants]}")
            over = self.variants[name]
            data["draft"] = _merged(data["draft"], over.draft)
            data["train"] = _merged(data["train"], over.train)
        try:
            return Recipe.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"variants.{name}.{error_location(err)}: {err['msg']}") from None

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        ids = self.aux_layer_ids
        # vLLM returns aux states in ascending layer order whatever the config lists, and id 0 (the
        # embeddings) crashes DeepSeek/Kimi's aux capture in vLLM (deepseek_v2.py adds a None residual)
        if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 1:
            raise ValueError(f"aux_layer_ids must be strictly ascending and >= 1, got {ids}")
        if self.limits.max_prompt_tokens >= self.limits.max_seq_len:
            raise ValueError("limits.max_prompt_tokens must be below limits.max_seq_len")
        if self.train.total_seq_len < 16:
            raise ValueError("train.total_seq_len must be at least 16")
        self._stream_consistent()
        for stage in ("capture", "extract", "evaluate"):
            if "--trust-remote-code" in getattr(self, stage).vllm.serve_args and not self.verifier.trust_remote_code:
                raise ValueError(f"{stage}.vllm.serve_args has --trust-remote-code: set verifier.trust_remote_code "
                                 "true (with verifier.revision pinned to a commit), or drop the flag")
        if self.evaluate.k > self.train.ttt_steps + 8:
            raise ValueError("evaluate.num_speculative_tokens is far above train.ttt_steps")
        return self

    def _stream_consistent(self) -> None:
        t, window, shard = self.train, self.store.window_bytes, self.extract.shard_bytes
        if t.later_epochs == "re-extract" and t.source != "stream":
            raise ValueError("train.later_epochs re-extract streams each epoch: it needs train.source: stream")
        if t.source == "stream":
            if window is None:
                raise ValueError("train.source stream needs store.window_bytes (e.g. 16 x extract.shard_bytes)")
            if window < WINDOW_SHARDS * shard:  # eagle_jobs/stream/__init__.py: why this many
                raise ValueError(f"store.window_bytes {window:,} is below {WINDOW_SHARDS} x extract.shard_bytes "
                                 f"({WINDOW_SHARDS * shard:,}): raise it or make the shards smaller")

    def digest(self, sections: tuple[str, ...] | None = None) -> str:
        """Content hash of the resolved recipe, or of some of its sections (lineage, cache keys)."""
        data = self.model_dump(mode="json", exclude={"variants"})  # arms of a comparison, not this run
        if sections is not None:
            data = {k: data[k] for k in sections}
        return content_hash(data, 16)

    def train_digest(self) -> str:
        """What a training checkpoint depends on: resuming under another value would be wrong. Not the
        step checkpoint interval: an operator may shorten it on a run that keeps being preempted; nor
        train.select_by, which chooses among the checkpoints after training (left out of the hash, so
        that checkpoints committed before the key existed still resume)."""
        same = self.model_copy(update={"train": self.train.model_copy(update={"checkpoint_every_minutes": None})})
        data = same.model_dump(mode="json", include={"verifier", "aux_layer_ids", "draft", "train"},
                               exclude={"train": {"select_by"}})
        return content_hash(data, 16)


def error_location(err: ErrorDetails) -> str:
    return ".".join(str(p) for p in err["loc"]) or "<top level>"


__all__ = [
    "BASE_VARIANT",
    "COMMIT",
    "CaptureSpec",
    "ChatSpec",
    "DraftSpec",
    "EMBEDDED_SMOLLM2",
    "EvaluateSpec",
    "ExtractSpec",
    "HUB_ID",
    "LONG_OUTPUT_SET",
    "LimitSpec",
    "LongOutputSpec",
    "LossName",
    "LossSpec",
    "MuonSpec",
    "NormSpec",
    "PromptSpec",
    "Recipe",
    "SamplingSpec",
    "Section",
    "StageBackend",
    "StoreSpec",
    "Throughputs",
    "TrainSpec",
    "VARIANT_NAME",
    "VariantSpec",
    "VerifierSpec",
    "VllmServerSpec",
    "WINDOW_SHARDS",
    "default_aux_layer_ids",
    "default_backend",
    "error_location",
    "is_hub_id",
    "vllm_installed",
]
