"""Loading the verifier on the transformers backends (CPU runs, tests).

Two things the seed run tripped over are handled here, once, for every stage:
- nested multimodal configs (Kimi-K2.5: model_type kimi_k25 with a deepseek_v3
  `text_config`): we load only the text model, from `text_config`;
- nested weight keys (`language_model.model.layers.*`, `language_model.lm_head.weight`):
  the `language_model.` prefix is stripped and vision-tower weights are skipped.
Where the files are (a mirror in the store, the embedded GGUF converted once into a cached
safetensors directory) is eagle_jobs.weights' business: this module asks it, never the reverse.

Nothing here runs the verifier repository's own code, whatever `verifier.trust_remote_code` says:
every process that imports this module holds the store's read-write key (prepare, the workers, train).
Configs are read as JSON into transformers' own classes, tokenizers and models load with
trust_remote_code=False; the repository's code runs only in the vLLM server, the one process that
holds no read-write key (components/vllm-sidecar; docs/OPERATIONS.md#secrets).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from transformers import CONFIG_MAPPING, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import VerifierSpec
from eagle_jobs.weights import cache_dir, resolve_path  # noqa: F401 - where the files are: weights owns it

# A nested multimodal checkpoint's text model, as its own class's keys: language_model.model.* and
# language_model.lm_head.* (Kimi-K2.5), or the legacy language_model.layers.* without ".model.".
TEXT_KEY_MAPPING = {r"^language_model\.(?!model\.|lm_head\.)": "model.", r"^language_model\.": ""}


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config of a (possibly multimodal) verifier."""
    return getattr(config, "text_config", None) or config


def config_from_dict(raw: dict) -> PretrainedConfig:
    """A config.json as transformers' own class for its model_type (kimi_k25, deepseek_v3, llama, ...),
    or, for a type transformers does not know, a plain PretrainedConfig holding its fields (a nested
    `text_config` converted the same way): the fields are what the stages read, and no class from the
    repository is imported."""
    if raw.get("model_type") in CONFIG_MAPPING:
        return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    outer = PretrainedConfig.from_dict({k: v for k, v in raw.items() if k not in ("text_config", "auto_map")})
    if isinstance(raw.get("text_config"), dict):
        outer.text_config = config_from_dict(raw["text_config"])
    return outer


def load_config(spec: VerifierSpec) -> PretrainedConfig:
    path = resolve_path(spec, "small")
    try:
        raw, _ = PretrainedConfig.get_config_dict(path, revision=spec.revision)
    except (OSError, ValueError) as e:
        raise BadInput(f"verifier {spec.model}: cannot read its config ({str(e).splitlines()[0]})") from None
    return config_from_dict(raw)


def num_layers(spec: VerifierSpec) -> int:
    n = getattr(text_config(load_config(spec)), "num_hidden_layers", None)
    if not isinstance(n, int):
        raise BadInput(f"verifier {spec.model}: its config names no num_hidden_layers")
    return n


def load_tokenizer(spec: VerifierSpec):
    path = resolve_path(spec, "small")
    try:
        tok = AutoTokenizer.from_pretrained(path, revision=spec.revision, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise BadInput(f"verifier {spec.model}: transformers cannot load its tokenizer without the repository's "
                       f"own code ({str(e).splitlines()[0]}), which eagle-jobs runs only in the vLLM server: "
                       "use the vllm backend for capture, extract and evaluate") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


if TYPE_CHECKING:
    # what AutoModelForCausalLM.from_pretrained is annotated to return: a PreTrainedModel with GenerationMixin
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM


@dataclass
class LoadedVerifier:
    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig  # the text config
    path: str

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)


@lru_cache(maxsize=2)
def _load_cached(spec: VerifierSpec) -> LoadedVerifier:
    return load_verifier_uncached(spec)


def load_verifier(spec: VerifierSpec) -> LoadedVerifier:
    return _load_cached(spec)  # frozen, so hashable: every field, weights included, keys the cache


def load_verifier_uncached(spec: VerifierSpec) -> LoadedVerifier:
    from transformers import AutoModelForCausalLM

    path = resolve_path(spec)
    config = load_config(spec)
    tcfg = text_config(config)
    dtype = getattr(torch, spec.dtype)
    tok = load_tokenizer(spec)
    model: CausalLM
    if tcfg is config:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, revision=spec.revision,
                                                         trust_remote_code=False, dtype=dtype)
        except ValueError as e:
            raise BadInput(f"verifier {spec.model}: transformers has no model class for it without the "
                           f"repository's own code ({str(e).splitlines()[0]}), which eagle-jobs runs only in "
                           "the vLLM server: use the vllm backend for capture, extract and evaluate") from None
    else:
        # Nested multimodal verifier: build the text model from text_config and
        # load the language_model.* weights into it (the vision tower is not needed).
        local = Path(path)
        if not local.is_dir():
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(path, revision=spec.revision, allow_patterns=["*.json", "*.safetensors"]))
        tcfg._attn_implementation = "sdpa"  # noqa: SLF001
        # transformers' own loader with the prefix mapped away: it also fuses the checkpoint's
        # per-expert MoE weights into its grouped layout; the vision tower's keys are left unread
        # output_loading_info=True returns (model, info); transformers' annotation names the model alone
        model, info = cast("tuple[CausalLM, dict]",
                           AutoModelForCausalLM.from_pretrained(local, config=tcfg, key_mapping=TEXT_KEY_MAPPING,
                                                                dtype=dtype, output_loading_info=True))
        missing = set(info["missing_keys"])
        if missing:
            raise BadInput(
                f"verifier {spec.model}: {len(missing)} text-model weights missing from the checkpoint "
                f"(first: {sorted(missing)[0]}); is it the right model?"
            )
    model.eval()
    return LoadedVerifier(model=model, tokenizer=tok, config=tcfg, path=path)
