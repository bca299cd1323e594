"""Helpers the pipeline tests share: a store with capture and extract committed (tests/test_train.py), the
recipe of a chain served by real vLLM (tests/test_vllm_real.py), and a report's speedup surface
(tests/test_speedup.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from conftest import free_port

from eagle_jobs.capture import run_capture
from eagle_jobs.extract import run_extract
from eagle_jobs.recipe import Recipe
from eagle_jobs.store import Store


# -- capture and extract committed, ready to train (tests/test_train.py) -------------------------------------
def _prepared(recipe, uri, run="r"):
    st = Store.open(uri)
    st.check()
    run_capture(recipe, st, run)
    run_extract(recipe, st, run)
    return st


# -- a verifier as real vLLM serves it in the chain (tests/test_vllm_real.py) --------------------------------
SERVE = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024"]


@dataclass
class Case:
    """One verifier as the chain serves it."""

    parser: str
    aux: list[int]
    draft: dict
    serve: list[str] = field(default_factory=list)
    train: dict = field(default_factory=dict)


CASES = {
    "smollm2": Case("deepseek_r1", [2, 15, 27], {"draft_vocab_size": 1024}),
    # text only: the wrapper's vision tower is neither built nor loaded (vLLM's --language-model-only)
    "tiny-kimi": Case("kimi_k2", [1, 2, 3], {"draft_vocab_size": 128, "num_attention_heads": 4,
                                             "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 128},
                      ["--language-model-only", "--max-model-len", "512"], {"epochs": 10, "lr": 3e-3}),
}


def make_recipe(model: Path, root: Path, prompts: Path, case: Case = CASES["smollm2"], **over) -> Recipe:
    server = {"serve_args": SERVE + case.serve, "health_timeout_s": 600}
    base = {
        "name": "real-vllm", "verifier": {"model": str(model)},
        "prompts": {"source": str(prompts), "validation": 0},
        "chat": {"reasoning_parser": case.parser},
        "sampling": {"temperature": 0.0, "max_new_tokens": 24},
        "limits": {"max_prompt_tokens": 200, "max_seq_len": 256},
        "aux_layer_ids": case.aux,
        "capture": {"backend": "vllm", "concurrency": 8, "vllm": {**server, "port": free_port()}},
        "extract": {"backend": "vllm", "scratch_dir": str(root / "scratch"), "vllm": {**server, "port": free_port()}},
        "draft": case.draft,
        "train": {"epochs": 6, "lr": 1e-3, "total_seq_len": 512, "ttt_steps": 3, **case.train},
        "evaluate": {"backend": "vllm", "num_speculative_tokens": 3, "max_new_tokens": 24,
                     "vllm": {**server, "port": free_port()}},
        "store": {"uri": f"file://{root}/store", "run_id": "r"},
    }
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) else v
    return Recipe.model_validate(base)


# -- a report's speedup surface (tests/test_speedup.py) ------------------------------------------------------
def _surface(cells: dict[tuple[int, int], float], tau: float | None = None) -> dict:
    """A speed table of (k, concurrency) -> speedup, every pass 4 requests of 64 tokens in 2 s."""
    def side(t):
        return {"requests": 4, "output_tokens": 64, "seconds": 2.0, "output_tokens_per_s": 32.0,
                "ttft_s_mean": 0.1, "ttft_s_p50": 0.1, "ttft_s_max": 0.2, "acceptance_length": t}

    surface = [{"k": k, "concurrency": c, "requests": 4, "with_draft": side(tau), "without_draft": side(None),
                "speedup": sp} for (k, c), sp in sorted(cells.items())]
    top = max(k for k, _c in cells)
    return {"max_tokens": 16, "levels": [x for x in surface if x["k"] == top], "surface": surface}
