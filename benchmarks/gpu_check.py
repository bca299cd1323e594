"""GPU check: speculators' GPU training path through our code, at the Kimi-K2.5 draft shape.

For a session lent an accelerator (the `device` tool): flex attention, the fused
Triton loss, bf16 autocast over fp32 master weights and torch.compile, all
through `eagle_jobs.train.run.run_train`, on a synthetic run whose shapes are
Kimi-K2.5's: hidden 7168, 64 heads x head_dim 128, intermediate 18432, verifier
vocab 163840, draft vocab 32000, aux layers [2, 30, 58] + final (61).

It writes a stand-in verifier directory holding only what the draft loads from a
verifier (embed_tokens, lm_head, final norm; a kimi_k25 config with a
deepseek_v3 text_config, weights under language_model.*), synthetic bf16 hidden
-state shards in our store format, and trains `--steps` steps under each of
`--optimizers` (each a variant on the same extraction, as `eagle-jobs compare`
trains arms). Prints tokens/s (speculators' own step profile), peak GPU memory
and, for two optimizers, their step-time ratio; then runs `inspect` on each
exported draft (what vLLM's EAGLE-3 loader needs).

    python benchmarks/gpu_check.py --steps 12 --seq-len 8192 --optimizers muon,adamw --out $OUT

`--ranks 1 [--fsdp]` trains through torchrun as a multi-GPU pod does (NCCL,
DDP/FSDP wrapping, the per-step stop agreement), at the world size one GPU allows.
`--shape tiny` runs the same script at a small shape on CPU (sdpa, eager loss):
tests/test_gpu_check.py does, so the script cannot rot between GPU sessions.
benchmarks/gpu_bundle.sh prepares what the device lacks; its header has the
one command for the device tool.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# Random weights and hidden states are drawn here: on the GPU, 2 x 1.2G weights take seconds, not minutes.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The Kimi-K2.5 draft shape (AQ-MedAI reference) and a small one for CPU runs of this script.
SHAPES = {
    "kimi": {"hidden": 7168, "heads": 64, "head_dim": 128, "intermediate": 18432, "vocab": 163840, "draft_vocab": 32000},
    "tiny": {"hidden": 256, "heads": 4, "head_dim": 64, "intermediate": 512, "vocab": 8192, "draft_vocab": 1024},
}


def fake_kimi_verifier(d: Path, hidden=7168, vocab=163840, layers=61) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    text = {"model_type": "deepseek_v3", "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab,
            "num_attention_heads": 64, "num_key_value_heads": 64, "intermediate_size": 18432,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "hidden_act": "silu",
            "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                                               "text_config": text}))
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def weight():
        return (torch.randn(vocab, hidden, device=DEVICE, generator=g) * 0.02).bfloat16().cpu()

    save_file({"language_model.model.embed_tokens.weight": weight(),
               "language_model.lm_head.weight": weight(),
               "language_model.model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)},
              str(d / "model.safetensors"))
    return d


def synthetic_run(store, run_id: str, samples: int, seq: int, hidden: int, vocab: int) -> None:
    from eagle_jobs.hsformat import Sample, encode_shard
    from eagle_jobs.store import Stage

    cap, ext = Stage(store, run_id, "capture"), Stage(store, run_id, "extract")
    rows, g = [], torch.Generator().manual_seed(1)
    gd = torch.Generator(device=DEVICE).manual_seed(2)
    for i in range(samples):
        ids = torch.randint(0, min(vocab, 32000), (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        mask[: seq // 8] = 0
        rows.append({"row_id": f"{i:08d}-00", "prompt_index": i, "split": "validation" if i == 0 else "train",
                     "input_ids": ids.tolist(), "loss_mask": mask.tolist(), "turn": 0})
        hs = torch.randn(seq, 4, hidden, device=DEVICE, generator=gd).bfloat16().cpu()
        blob, index = encode_shard([Sample(rows[-1]["row_id"], hs, ids, mask)], [2, 30, 58, 61], "bfloat16")
        for e in index:
            e.update(split=rows[-1]["split"], prompt_index=i, loss_tokens=int(mask.sum()))
        ext.commit_shard(f"s{i:04d}", {f"s{i:04d}.safetensors": blob},
                         {"layer_ids": [2, 30, 58, 61], "hidden_size": hidden, "storage": "bfloat16", "samples": index})
    cap.commit_shard("rows", {"rows.jsonl": "".join(json.dumps(r) + "\n" for r in rows).encode()}, {})
    cap.complete({})
    ext.complete({})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=14)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="kimi")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpu-check"))
    ap.add_argument("--ranks", type=int, default=0,
                    help="train as this many torchrun ranks, as a pod with several GPUs does (DDP over NCCL on GPUs, "
                         "gloo on CPU); 0: in this process, with peak memory")
    ap.add_argument("--fsdp", action="store_true", help="with --ranks: FSDP instead of DDP")
    ap.add_argument("--loss", choices=["auto", "fused", "eager"], default="auto",
                    help="train.loss.implementation (auto: speculators' fused Triton kernels on a GPU)")
    ap.add_argument("--num-workers", type=int, default=2,
                    help="train.num_workers: DataLoader workers loading samples ahead of the step (the Kimi recipe's 2)")
    ap.add_argument("--optimizers", default="muon",
                    help="comma-separated train.optimizer values, each trained as its own arm on the same "
                         "extraction; two: their step-time ratio (muon is the Kimi recipe's default)")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    assert gpu or args.shape == "tiny", "the Kimi shape needs a GPU; use --shape tiny on CPU"

    from eagle_jobs.recipe import Recipe
    from eagle_jobs.store import Store

    sh, work = SHAPES[args.shape], args.out
    verifier = fake_kimi_verifier(work / "verifier", sh["hidden"], sh["vocab"])
    store = Store.open(f"file://{work}/store")
    synthetic_run(store, "gpu", args.samples, args.seq_len, sh["hidden"], sh["vocab"])
    recipe = Recipe.model_validate({
        "name": "gpu-check", "verifier": {"model": str(verifier), "dtype": "bfloat16"},
        "prompts": {"source": "pypi://sharegpt"}, "aux_layer_ids": [2, 30, 58],
        "draft": {"hidden_size": sh["hidden"], "num_attention_heads": sh["heads"], "num_key_value_heads": sh["heads"],
                  "head_dim": sh["head_dim"], "intermediate_size": sh["intermediate"],
                  "draft_vocab_size": sh["draft_vocab"]},
        "train": {"epochs": 1, "lr": 1e-4, "total_seq_len": args.seq_len, "ttt_steps": 3, "log_freq": 1,
                  "fsdp": args.fsdp, "loss": {"implementation": args.loss},
                  "num_workers": args.num_workers},
    })
    results = {}
    for optimizer in args.optimizers.split(","):
        # Each optimizer is one arm on the same committed extraction (speculators' compile cache warm after the first).
        try:
            results[optimizer] = train_arm(args, recipe, store, optimizer, work, gpu)
        except Exception as e:  # one arm's failure is a result too; the next arm still runs
            results[optimizer] = {"optimizer": optimizer, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(results[optimizer], indent=1), flush=True)
    opts = list(results)
    if len(opts) == 2 and all("median_step_ms" in r for r in results.values()):
        results["step_ratio"] = {f"{opts[0]}/{opts[1]}": results[opts[0]]["median_step_ms"] / results[opts[1]]["median_step_ms"]}
    name = f"gpu_check-ranks{args.ranks}{'-fsdp' if args.fsdp else ''}.json" if args.ranks else "gpu_check.json"
    (work / name).write_text(json.dumps(results, indent=1))
    if any("error" in r for r in results.values()):
        raise SystemExit(f"gpu_check: an arm failed; see {work / name}")
    return results


def train_arm(args, recipe, store, optimizer: str, work: Path, gpu: bool) -> dict:
    """Train `args.steps` steps of the draft under `optimizer` (a compare-style variant of run gpu); its figures."""
    from eagle_jobs.checkpoint_check import run_inspect
    from eagle_jobs.committed import download_final
    from eagle_jobs.errors import ExitCode
    from eagle_jobs.train.launch import Ranks, run_ranks
    from eagle_jobs.train.run import run_train

    recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"optimizer": optimizer})})
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.time()
    if args.ranks:
        rec = run_ranks(recipe, store, "gpu", args.steps, work / "w" / optimizer, Ranks(args.ranks), variant=optimizer)
    else:
        rec = run_train(recipe, store, "gpu", max_steps=args.steps, work_dir=work / "w", variant=optimizer)
    wall = time.time() - t
    prof = [m["profile"] for m in rec["metrics"] if m.get("profile")]
    steady = prof[3:] or prof
    losses = [m["train"]["loss_0"] for m in rec["metrics"] if "loss_0" in m.get("train", {})]
    final = download_final(store, "gpu", work / "final" / optimizer, variant=optimizer)
    return {
        "optimizer": optimizer, "num_workers": recipe.train.num_workers, "shape": args.shape, "world_size": rec["world_size"], "fsdp": args.fsdp,
        "attention": rec["attention"], "loss": rec["loss_implementation"],
        "hidden_states_dtype": rec["hidden_states_dtype"], "parameters": rec["parameters"], "steps": len(prof),
        "seq_len": args.seq_len, "median_step_ms": statistics.median(p["step_ms"] for p in steady),
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in steady),
        "fetch_frac": statistics.median(p["fetch_frac"] for p in steady),  # data loading's share of a step
        "first_step_ms (compile)": prof[0]["step_ms"] if prof else None,
        "loss_first_last": [losses[0], losses[-1]] if losses else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu and not args.ranks else None,
        "wall_s": wall,
        "inspect_ok": run_inspect(str(final)) == ExitCode.OK,
        "device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__,
    }


if __name__ == "__main__":
    main()
