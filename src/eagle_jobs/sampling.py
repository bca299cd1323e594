"""Sampling as the verifier is served: one set of effective parameters for both capture backends.

vLLM 0.32.0 decides each sampling field of a chat request in this order: the request's value, else the
server's default, else the OpenAI default (ChatCompletionRequest.to_sampling_params and
_DEFAULT_SAMPLING_PARAMS, vllm/entrypoints/openai/chat_completion/protocol.py: "Priority: user ->
server default -> OpenAI default"). The server's defaults are ModelConfig.get_diff_sampling_param
(vllm/config/model.py): under `--generation-config auto` (the default) the fields the model's
generation_config.json sets (GenerationConfig.from_pretrained(model).to_diff_dict(), or
GenerationConfig.from_model_config when there is no such file: try_get_generation_config in
vllm/transformers_utils/config.py), under `--generation-config vllm` none, under a folder that folder's
file; `--override-generation-config` goes on top in every mode; only repetition/presence/frequency
penalties, temperature, top_k, top_p, min_p and max_new_tokens are kept. A Qwen3 verifier served so
samples with its top_k 20 although no request names top_k.

`effective(recipe)` resolves the recipe's `sampling` the same way, once. Capture then sends every field
explicitly (so a server's own flags never decide) and the transformers backend samples with
ServedSampling, which applies them as vLLM's sampler does (vllm/v1/sample/sampler.py: penalties, then
temperature, then min_p, then top_k and top_p).
"""

from __future__ import annotations

import json

import torch

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe

# vLLM's own defaults for a field neither the request nor the server sets (_DEFAULT_SAMPLING_PARAMS)
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}
# get_diff_sampling_param's available_params: what a generation config may set for the server
SERVED_FIELDS = (*NEUTRAL, "max_new_tokens")
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it is greedy (sampler.py)


def _serve_flag(args: list[str], name: str) -> str | None:
    """The value of `name` in `vllm serve` arguments; the last one wins, as with argparse."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _model_generation_config(recipe: Recipe, source: str) -> dict:
    """try_get_generation_config(...).to_diff_dict(): the file's fields, or the model config's."""
    from transformers import GenerationConfig

    from eagle_jobs.verifier import load_config, resolve_path

    v = recipe.verifier
    path = resolve_path(v, "small") if source == "auto" else source
    try:
        # None is the repo's default branch (transformers' resolve_revision), though from_pretrained annotates str
        revision = v.revision if source == "auto" else None
        config = GenerationConfig.from_pretrained(path, revision=revision)  # type: ignore[arg-type]
    except OSError:
        if source != "auto":
            raise BadInput(f"sampling.generation_config: no generation_config.json in '{source}' (use auto, "
                           "vllm, or a folder holding one)") from None
        config = GenerationConfig.from_model_config(load_config(v))
    return config.to_diff_dict()


def served_defaults(recipe: Recipe) -> tuple[str, dict, int | None]:
    """(mode, fields, cap): what the verifier's server fills into a request that leaves fields unset,
    and the cap it puts on max_tokens.

    mode: sampling.generation_config, else the capture server's --generation-config, else vLLM's
    default `auto`; --override-generation-config from capture.vllm.serve_args applies in every mode.
    A max_new_tokens caps requests only from a folder or from the override
    (OpenAIServingChat.override_max_tokens, vllm/entrypoints/openai/chat_completion/serving.py)."""
    args = recipe.capture.vllm.serve_args
    mode = recipe.sampling.generation_config or _serve_flag(args, "--generation-config") or "auto"
    config = {} if mode == "vllm" else _model_generation_config(recipe, mode)
    try:
        override = json.loads(_serve_flag(args, "--override-generation-config") or "{}")
    except json.JSONDecodeError:
        raise BadInput("capture.vllm.serve_args: --override-generation-config is not JSON") from None
    config.update(override)
    fields = {p: config[p] for p in SERVED_FIELDS if config.get(p) is not None}
    if "max_new_tokens" in fields:  # transformers' name for vLLM's max_tokens, renamed as vLLM does
        fields["max_tokens"] = fields.pop("max_new_tokens")
    cap = fields.get("max_tokens") if mode not in ("auto", "vllm") else override.get("max_new_tokens")
    return mode, fields, cap


def effective(recipe: Recipe) -> dict:
    """The sampling parameters capture applies on either backend, and records in its manifests."""
    s = recipe.sampling
    mode, served, cap = served_defaults(recipe)
    out: dict = {}
    for name, neutral in NEUTRAL.items():
        mine = getattr(s, name)
        out[name] = float(mine if mine is not None else served.get(name, neutral))
    out["top_k"] = max(0, int(out["top_k"]))  # vLLM: 0 and -1 both mean off
    out["max_tokens"] = min(s.max_new_tokens, int(cap)) if cap else s.max_new_tokens
    out["seed"] = s.seed
    out["generation_config"] = mode
    out["from_generation_config"] = sorted(n for n in NEUTRAL if getattr(s, n) is None and n in served)
    return out


def request_fields(params: dict) -> dict:
    """The chat request's sampling fields: every one explicit (a request value beats any server default)."""
    return {**{n: params[n] for n in NEUTRAL}, "max_tokens": params["max_tokens"]}


class ServedSampling:
    """vLLM's sampler as a transformers logits processor.

    Run under greedy generate (do_sample=False, so none of transformers' own warpers apply): it applies
    the penalties, and when sampling, temperature, min_p, top_k and top_p in vLLM's order, draws one
    token and returns scores whose argmax is that token. Prompts are left-padded to `width`; the padding
    is no prompt token (vLLM pads nothing), so the repetition penalty never sees it.
    """

    def __init__(self, params: dict, prompt_lens: list[int], width: int, generator: torch.Generator):
        self.p, self.width, self.generator = params, width, generator
        self.prompt_lens = prompt_lens

    def _penalize(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        p = self.p
        rep, pres, freq = p["repetition_penalty"], p["presence_penalty"], p["frequency_penalty"]
        if rep == 1.0 and pres == 0.0 and freq == 0.0:
            return logits
        vocab = logits.shape[-1]
        out_counts = torch.zeros_like(logits)
        out = input_ids[:, self.width:]
        out_counts.scatter_add_(1, out, torch.ones_like(out, dtype=logits.dtype))
        seen = out_counts > 0
        for i, n in enumerate(self.prompt_lens):  # apply_repetition_penalties_torch: prompt or output tokens
            seen[i, input_ids[i, self.width - n: self.width].clamp(max=vocab - 1)] = True
        scale = torch.where(seen, torch.full_like(logits, rep), torch.ones_like(logits))
        logits = logits * torch.where(logits > 0, 1.0 / scale, scale)
        # apply_penalties (vllm/model_executor/layers/utils.py): the OpenAI definitions, output tokens only
        return logits - freq * out_counts - pres * seen.logical_and(out_counts > 0).to(logits.dtype)

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """temperature, min_p, top_k, top_p: the logits the draw is made from (masked with -inf)."""
        p = self.p
        logits = logits / p["temperature"]
        if p["min_p"] > 0:  # MinPLogitsProcessor.apply (vllm/v1/sample/logits_processor/builtin.py)
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < probs.amax(-1, keepdim=True) * p["min_p"], float("-inf"))
        if 0 < p["top_k"] < logits.shape[-1]:  # apply_top_k_top_p_pytorch (vllm/v1/sample/ops/topk_topp_sampler.py)
            kth = logits.topk(p["top_k"], dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p["top_p"] < 1.0:
            srt, idx = logits.sort(dim=-1, descending=False)
            drop = srt.softmax(-1).cumsum(-1) <= 1 - p["top_p"]
            drop[:, -1] = False  # at least one
            logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
        return logits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = self._penalize(input_ids, scores.float())
        if self.p["temperature"] < GREEDY_BELOW:
            return logits  # greedy on the penalized logits, as vLLM's greedy_sample
        probs = self.filter(logits).softmax(-1)
        token = torch.multinomial(probs, 1, generator=self.generator)
        return torch.full_like(logits, float("-inf")).scatter(-1, token, 0.0)
