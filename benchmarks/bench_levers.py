"""The cost of a training step under each arm of a recipe's comparison, against its base recipe.

`eagle-jobs compare` reports each arm's training time, but on a shared machine those times
are the neighbours' as much as the arm's. Here every arm's draft is built as run_train builds
it (speculators' Eagle3DraftModel with the arm's draft.architecture and draft.norms, its
loss and ttt_steps, its optimizer through speculators' own build_optimizers), and the arms
take turns, one step each, on the same demo-shaped batches (train.total_seq_len tokens of
random hidden states, two packed documents): the ratio of each arm's median step to the
base's is measured in one run, so the machine's load cancels. A step is forward, backward
and the optimizer (Muon's Newton-Schulz included).

    .venv/bin/python benchmarks/bench_levers.py [--recipe jobs/demo.yaml] [--arms muon,qwen3] [--steps 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import REPO


def build_arm(recipe):
    """The draft, its optimizers and what its forward is called with, as run_train sets them up on CPU."""
    import torch
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig

    from eagle_jobs import speculators_compat as compat
    from eagle_jobs.draft import build_draft_model, optimizer_settings, resolve_shape, trainer_call_kwargs
    from eagle_jobs.verifier import load_config, text_config

    compat.install()
    tcfg = text_config(load_config(recipe.verifier))
    shape = resolve_shape(recipe, tcfg)
    t2d = torch.zeros(shape.verifier_vocab_size, dtype=torch.bool)
    t2d[: shape.draft_vocab_size] = True
    d2t = t2d.nonzero().squeeze(1) - torch.arange(shape.draft_vocab_size)
    torch.manual_seed(0)
    model = build_draft_model(shape, recipe, tcfg, "sdpa", t2d, d2t)
    cfg = TrainerConfig(num_epochs=1, save_path="/nonexistent", **optimizer_settings(recipe))
    return model, build_optimizers(model, cfg), trainer_call_kwargs(recipe, "eager")[0], shape


def batch(recipe, shape, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    T, H, n_aux = recipe.train.total_seq_len, shape.hidden_size, len(recipe.aux_layer_ids)
    docs = (T // 2 - 7, T - (T // 2 - 7))
    return {"hidden_states": torch.randn(1, T, n_aux * H, generator=g),
            "input_ids": torch.randint(0, shape.draft_vocab_size, (1, T), generator=g),
            "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])[None],
            "loss_mask": (torch.rand(1, T, generator=g) > 0.3).float(),
            "position_ids": torch.cat([torch.arange(1, n + 1) for n in docs])[None],
            "verifier_last_hidden_states": torch.randn(1, T, H, generator=g)}


def step(model, optimizers, kwargs, b) -> float:
    t0 = time.perf_counter()
    out = model(**b, **kwargs)
    loss = out[1] if isinstance(out, tuple) else out.loss
    loss.backward()
    for o in optimizers:
        o.step()
        o.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(REPO / "jobs/demo.yaml"))
    ap.add_argument("--arms", default="", help="comma-separated variants (default: every variant)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    from eagle_jobs.recipe_file import load_recipe

    recipe = load_recipe(args.recipe)
    names = ["base", *(args.arms.split(",") if args.arms else recipe.variants)]
    arms = {n: build_arm(recipe if n == "base" else recipe.variant(n)) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        for n in (names if i % 2 == 0 else names[::-1]):  # alternate the order: no arm always runs first
            model, opts, kwargs, shape = arms[n]
            dt = step(model, opts, kwargs, batch(recipe, shape, i))
            if i >= args.warmup:
                times[n].append(dt)
    base = statistics.median(times["base"])
    print(f"{recipe.name}: median step over {args.steps} steps of {recipe.train.total_seq_len} tokens, "
          f"arms interleaved in one process")
    print(f"{'arm':24} {'step ms':>8} {'vs base':>8}")
    for n in names:
        med = statistics.median(times[n])
        print(f"{n:24} {med * 1e3:8.1f} {med / base:8.2f}")


if __name__ == "__main__":
    main()
