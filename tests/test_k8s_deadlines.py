"""Deadlines from the plan, and the vLLM stages' progress heartbeat.

A vLLM stage's worker touches a heartbeat file as it makes progress (src/eagle_jobs/heartbeat.py);
the rendered startup and liveness probes fail the pod once it is 30 minutes stale. The wall-clock
activeDeadlineSeconds stays only as a backstop for pods that never start, and every stage's is at
least what `eagle-jobs plan` says it must cover for the overlay's own recipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import kustomize

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ["dev", "smoke", "full", "full-multinode", "full-b200", "full-gb200", "qwen3-8b-1gpu"]
VLLM_STAGES = ["capture", "extract", "evaluate"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: kustomize(REPO / "k8s/overlays" / o) for o in OVERLAYS}


def _jobset(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "JobSet")


def _job(js: dict, stage: str) -> dict:
    return next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == stage)["template"]["spec"]


def _recipe(docs: list[dict]):
    from eagle_jobs.recipe_file import recipe_from_text

    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "recipe.yaml" in d.get("data", {}))
    return recipe_from_text(cm["data"]["recipe.yaml"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_stage_deadline_covers_what_the_plan_says_it_must(rendered, overlay):
    from eagle_jobs.plan import make_plan, server_load_s

    js = _jobset(rendered[overlay])
    plan = make_plan(_recipe(rendered[overlay]))
    for stage, est in plan["stages"].items():
        deadline = _job(js, stage)["activeDeadlineSeconds"]
        assert deadline >= est["deadline_floor_s"] > est["time_s"], (overlay, stage, deadline, est)
    # the load budget the floor adds is how long the stage's worker waits for its servers, the recipe's own
    # health_timeout_s each: one for capture and extract; for evaluate, every plan its prepare writes and its
    # sidecar serves (serve_plans.evaluate_plans; tests/test_speedup.py checks that a pod's evaluate asks for
    # exactly those, in that order)
    from eagle_jobs.serve_plans import evaluate_plans

    recipe = _recipe(rendered[overlay])
    for stage in ("capture", "extract", "evaluate"):
        spec = getattr(recipe, stage)
        servers = len(evaluate_plans(recipe, Path("draft"), Path("untrained"))) if stage == "evaluate" else 1
        assert servers >= (3 if stage == "evaluate" else 1)  # evaluate: the draft, the untrained one, no draft
        assert server_load_s(recipe, stage) == (servers * spec.vllm.health_timeout_s if spec.backend == "vllm" else 0)
        if spec.backend == "vllm":
            assert plan["stages"][stage]["deadline_floor_s"] > spec.vllm.health_timeout_s


def _probe_env(tmp_path: Path) -> dict:
    """PATH as in the image: `python3` is the interpreter eagle_jobs is installed in."""
    bindir = tmp_path / "probe-bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # a symlink would lose the venv
    (bindir / "python3").chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


def _probe(command: list[str], env: dict, max_age_s: float | None = None) -> subprocess.CompletedProcess:
    """The probe's exec command, as the kubelet runs it; max_age_s shortens its window for a test."""
    cmd = [*command[:-1], str(max_age_s)] if max_age_s is not None else command
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_vllm_workers_are_failed_after_half_an_hour_without_progress(rendered, overlay, tmp_path):
    js = _jobset(rendered[overlay])
    env = _probe_env(tmp_path)
    for stage in VLLM_STAGES:
        worker = _job(js, stage)["template"]["spec"]["containers"][0]
        beat = next(e["value"] for e in worker["env"] if e["name"] == "EAGLE_JOBS_HEARTBEAT")
        start, live = worker["startupProbe"], worker["livenessProbe"]
        assert start["exec"] == live["exec"] and live["exec"]["command"][-2] == beat
        max_age = float(live["exec"]["command"][-1])
        assert 25 * 60 <= max_age + live["periodSeconds"] * live["failureThreshold"] <= 40 * 60
        assert start["periodSeconds"] * start["failureThreshold"] >= 30 * 60  # time to the first progress
        assert start["timeoutSeconds"] >= 5 and live["timeoutSeconds"] >= 5
        # run as the kubelet does, on a file made where the pod makes it
        cmd = [c.replace(beat, str(tmp_path / "heartbeat")) for c in live["exec"]["command"]]
        missing = _probe(cmd, env)
        assert missing.returncode == 1 and "no progress since it started" in missing.stdout
        (tmp_path / "heartbeat").touch()
        assert _probe(cmd, env).returncode == 0
        old = time.time() - max_age - 60
        os.utime(tmp_path / "heartbeat", (old, old))
        stale = _probe(cmd, env)
        assert stale.returncode == 1 and len(stale.stdout.strip().splitlines()) == 1 and "no progress" in stale.stdout
        (tmp_path / "heartbeat").unlink()
    # training and the mirror keep a deadline only: no vLLM, no heartbeat
    assert "livenessProbe" not in _job(js, "train")["template"]["spec"]["containers"][0]


def test_a_stage_beats_while_it_progresses_and_its_probe_fails_once_it_stalls(rendered, tiny_recipe, tmp_path,
                                                                            monkeypatch):
    """A real capture: the heartbeat is fresh while conversations complete; when its server stops
    answering (here: the second shard never returns), the rendered probe fails once the file is
    older than its window (shortened to 3 s), and passes again when progress resumes."""
    from eagle_jobs import capture as capture_mod
    from eagle_jobs.capture import run_capture
    from eagle_jobs.store import Stage, Store

    worker = _job(_jobset(rendered["full"]), "capture")["template"]["spec"]["containers"][0]
    beat = tmp_path / "heartbeat"
    cmd = [c.replace("/work/heartbeat", str(beat)) for c in worker["livenessProbe"]["exec"]["command"]]
    env = _probe_env(tmp_path)
    monkeypatch.setenv("EAGLE_JOBS_HEARTBEAT", str(beat))
    real = capture_mod.TransformersBackend.run
    stalled, resume, calls = threading.Event(), threading.Event(), {"n": 0}

    def hangs_on_the_second_shard(self, convs, stats, advance):
        calls["n"] += 1
        if calls["n"] == 2:
            stalled.set()
            resume.wait(timeout=120)  # a server that stopped answering
        return real(self, convs, stats, advance)

    monkeypatch.setattr(capture_mod.TransformersBackend, "run", hangs_on_the_second_shard)
    recipe, st = tiny_recipe(), Store.open(f"file://{tmp_path}/s")
    t0 = time.time()
    run = threading.Thread(target=run_capture, args=(recipe, st, "hb"), daemon=True)
    run.start()
    assert stalled.wait(timeout=180)
    assert beat.stat().st_mtime >= t0 and _probe(cmd, env).returncode == 0  # beating up to the stall
    deadline = time.monotonic() + 30
    while _probe(cmd, env, 3).returncode == 0:
        assert time.monotonic() < deadline, "the heartbeat went on without progress"
        time.sleep(0.5)
    assert "no progress" in _probe(cmd, env, 3).stdout
    resume.set()
    run.join(timeout=180)
    assert not run.is_alive() and Stage(st, "hb", "capture").is_complete()
    assert _probe(cmd, env, 3).returncode == 0  # the end of the stage beat too


def test_a_worker_beats_while_it_waits_for_its_sidecar_and_fails_at_the_recipes_health_timeout(tmp_path, monkeypatch):
    """The vLLM sidecar has no startup probe, so the worker starts beside a server that is still loading: it
    beats its heartbeat while /health does not answer (its startup probe must not kill it during a long
    load), and ends with exit 5 and the reason once the stage's vllm.health_timeout_s has passed."""
    import http.server
    import socket

    from eagle_jobs import heartbeat
    from eagle_jobs.errors import ExitCode, Unavailable
    from eagle_jobs.vllm_server import wait_healthy

    beat = tmp_path / "heartbeat"
    monkeypatch.setenv("EAGLE_JOBS_HEARTBEAT", str(beat))
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.0)
    with socket.socket() as s:  # a port nothing listens on: the server is not up yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    with pytest.raises(Unavailable) as e:
        wait_healthy(f"http://127.0.0.1:{port}", 5.0)  # it polls every 2 s
    assert e.value.code == ExitCode.UNAVAILABLE and "not healthy after 5s" in str(e.value)
    assert beat.stat().st_mtime >= t0 + 3.5  # still beating at its last poll, 4 s into the wait
    # a server that comes up within the timeout ends the wait
    ready = threading.Event()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if ready.is_set() else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    threading.Timer(1.0, ready.set).start()
    try:
        wait_healthy(f"http://127.0.0.1:{srv.server_address[1]}", 30.0)
    finally:
        srv.shutdown()
    assert ready.is_set()


def test_the_deadline_floors_operations_md_gives_for_kimi_are_plans(monkeypatch):
    """docs/OPERATIONS.md#deadlines quotes each stage's floor for jobs/kimi-k2.5.yaml: the figures plan gives."""
    import re

    from eagle_jobs.plan import make_plan
    from eagle_jobs.recipe_file import load_recipe

    monkeypatch.setenv("EAGLE_JOBS_STORE", "s3://eagle-jobs")
    stages = make_plan(load_recipe(REPO / "jobs/kimi-k2.5.yaml"))["stages"]
    floors = {k: v["deadline_floor_s"] for k, v in stages.items()}
    text = " ".join((REPO / "docs/OPERATIONS.md").read_text().split())
    said = re.search(r"For Kimi-K2\.5 \(`full`, 600,000 conversations\) that is ([\d,]+) s for capture, ([\d,]+) s for "
                     r"extraction \(four pods\), ([\d,]+) s for training and ([\d,]+) s for evaluation", text)
    assert said, "the sentence with Kimi-K2.5's floors moved or changed"
    assert [int(x.replace(",", "")) for x in said.groups()] == [
        floors["capture"], floors["extract"], floors["train"], floors["evaluate"]]
