"""Peak memory of evaluate's untrained draft (the τ baseline a vLLM server loads) at a recipe's draft shape.

In a pod the evaluate worker builds it beside its vLLM sidecar, within the worker's memory limit
(k8s/components/vllm-sidecar). Here the build runs on a verifier directory of the recipe's hidden size,
depth and vocabulary (DeepSeek-V3 config, random bf16 embeddings and head in two safetensors shards) and a
draft config of the recipe's shape, each build in a process of its own whose peak RSS (getrusage) is the
figure: `save_untrained` (built in bf16) and, with --fp32 in the same run, the fp32 build cast to bf16.

    .venv/bin/python benchmarks/bench_untrained_draft.py --recipe jobs/kimi-k2.5.yaml --work /tmp/untrained [--fp32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BUILD = r"""
import json, resource, sys, time
from pathlib import Path
import torch
from eagle_jobs.evaluate.decode import load_draft, save_untrained
draft, verifier, out, how = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
if how == "bf16":
    save_untrained(draft, verifier, 0, out)
else:  # what evaluate did before save_untrained: fp32, then cast
    load_draft(draft, verifier, untrained=True).to(torch.bfloat16).save_pretrained(out)
print(json.dumps({"how": how, "seconds": time.perf_counter() - start,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_verifier(path: Path, recipe) -> None:
    """config.json and the two tensors speculators reads from a verifier: embed_tokens and lm_head."""
    import torch
    from safetensors.torch import save_file

    from eagle_jobs.plan import verifier_text_config

    text = verifier_text_config(recipe)  # plan's numbers where the config is remote (Kimi-K2.5's)
    d, vocab = int(text.hidden_size), int(text.vocab_size)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": int(text.num_hidden_layers), "hidden_size": d, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": vocab,
        "max_position_embeddings": 8192, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
    weight_map = {}
    for i, key in enumerate(("model.embed_tokens.weight", "lm_head.weight")):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        if not (path / shard).is_file():  # one tensor at a time: this process stays out of the figure
            save_file({key: torch.randn(vocab, d, dtype=torch.bfloat16) * 0.02}, str(path / shard))
        weight_map[key] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_draft_config(path: Path, recipe, verifier: Path) -> int:
    """The draft's config.json and its vocab mapping, as a trained draft's directory holds them; its
    parameter count."""
    import torch
    from safetensors.torch import save_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    from eagle_jobs.draft import layer_config, resolve_shape

    text_cfg = AutoConfig.from_pretrained(str(verifier))
    shape = resolve_shape(recipe, text_cfg)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config(shape, recipe, text_cfg, "sdpa"),
        draft_vocab_size=shape.draft_vocab_size, **recipe.draft.norms.model_dump(),
        eagle_aux_hidden_state_layer_ids=recipe.aux_layer_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=recipe.train.ttt_steps)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(verifier))))
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    vocab = text_cfg.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[: shape.draft_vocab_size] = True
    d2t = torch.zeros(shape.draft_vocab_size, dtype=torch.long)
    save_file({"t2d": t2d, "d2t": d2t}, str(path / "model.safetensors"))
    return shape.draft_vocab_size


def main(argv: list[str] | None = None) -> int:
    from eagle_jobs.recipe_file import load_recipe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=Path("jobs/kimi-k2.5.yaml"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--fp32", action="store_true", help="also the fp32 build cast to bf16, for the ratio")
    a = ap.parse_args(argv)
    recipe = load_recipe(a.recipe)
    verifier, draft = a.work / "verifier", a.work / "draft"
    started = time.perf_counter()
    write_verifier(verifier, recipe)
    write_draft_config(draft, recipe, verifier)
    print(f"inputs written in {time.perf_counter() - started:.0f} s", flush=True)
    results = []
    for how in ("bf16", "fp32") if a.fp32 else ("bf16",):
        out = subprocess.run([sys.executable, "-c", BUILD, str(draft), str(verifier), str(a.work / f"out-{how}"), how],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["saved_bytes"] = sum(f.stat().st_size for f in (a.work / f"out-{how}").glob("*.safetensors"))
        results.append(r)
        print(f"{how}: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, {r['seconds']:.0f} s, "
              f"saved {r['saved_bytes'] / 2**30:.2f} GiB", flush=True)
    (a.work / "untrained.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
