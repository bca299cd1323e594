"""A tiny Kimi-K2.5-shaped verifier, built from scratch for tests.

Same shape of problem as the real checkpoint, so the paths that broke in the
seed run execute in every test:
- config.json: model_type "kimi_k25" with a nested deepseek_v3 `text_config`
  (MLA attention and routed MoE experts), as moonshotai/Kimi-K2.5 ships it;
- weights saved under `language_model.model.*` / `language_model.lm_head.weight`,
  beside a vision tower we never load;
- a byte-level BPE tokenizer with <think>/</think> and a chat template that
  opens a thinking block unless `thinking=False`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIALS = ["[EOS]", "[PAD]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_end|>", "<think>", "</think>"]

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
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    cfg = Kimi_K25Config(text_config=text.to_dict())
    cfg.architectures = ["KimiK25ForConditionalGeneration"]
    cfg.eos_token_id = tok.eos_token_id
    cfg.save_pretrained(out)
    torch.manual_seed(seed)
    lm = DeepseekV3ForCausalLM(text).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy text varies
        lm.lm_head.weight.mul_(8.0)
    sd = {f"language_model.{k}": v.contiguous() for k, v in lm.state_dict().items()}
    sd["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)  # never loaded
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                            "pad_token_id": tok.pad_token_id}))
    return out
