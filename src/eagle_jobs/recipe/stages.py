"""The recipe's sections for what each stage does: capture, extract, the draft and its training, evaluate."""


from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle_jobs.recipe.sections import (
    Section,
    StageBackend,
    VllmServerSpec,
)


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

    def other_ks(self) -> list[int]:
        """Each k of num_speculative_tokens beside k: a speed-pass server each (τ is measured at k)."""
        return [k for k in self.num_speculative_tokens if k != self.k]
