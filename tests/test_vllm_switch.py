"""A pod's vLLM sidecar serving several prepared plans, one at a time, switched by the worker
(eagle_jobs/vllm_switch.py), through the real `eagle-jobs exec-vllm` process.

The servers here are a stand-in for `vllm serve`, for fault injection only: each answers /health and
says which plan it is, and leaves a child behind in its process group when it is stopped, as vLLM 0.32's
API server leaves its engine core when the core does not stop in time (vllm/v1/utils.py shutdown()).
The sidecar must stop that group whole before it starts the next plan. Real vLLM through the same
sidecar: tests/test_speedup.py::test_a_pod_sidecar_measures_the_speed_surface_and_the_baseline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import free_port
from proc_helpers import EAGLE_JOBS

from eagle_jobs.errors import BadInput
from eagle_jobs.vllm_switch import PreparedPlans, request_path, state_path, switch_to

SERVER = r'''
import json, os, signal, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port, name, exit_code = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if exit_code != "-":
    sys.exit(int(exit_code))
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", IGNORE_TERM])
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"plan": name, "pid": os.getpid(), "child": child.pid}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # its child stays: the sidecar stops the group
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def prepared(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    plans = {name: {"argv": [sys.executable, str(script), str(port), name, code], "env": {"PLAN_NAME": name}}
             for name, code in (("draft-k3", "-"), ("no-draft", "-"), ("broken", "7"))}
    f = tmp_path / "vllm-serve.json"
    PreparedPlans(plans, "draft-k3").write(f)
    return f, f"http://127.0.0.1:{port}"


def _sidecar(f: Path, out=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([EAGLE_JOBS, "exec-vllm", str(f)], stdout=out, stderr=subprocess.STDOUT, text=True)


def _serving(base: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return httpx.get(f"{base}/health", timeout=2).json()
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"nothing answers on {base}")


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return out


def test_the_sidecar_serves_the_plan_the_worker_asks_for_after_the_last_one_is_gone(prepared):
    f, base = prepared
    sidecar = _sidecar(f)
    try:
        first = _serving(base)
        assert first["plan"] == "draft-k3"  # no request yet: the first plan
        switch_to(f, "draft-k3", 60)  # already served: nothing asked
        assert not request_path(f).exists()
        switch_to(f, "no-draft", 120)
        # the state answers the request only once the old group is gone: its left-behind child included
        assert not psutil.pid_exists(first["pid"]) and not psutil.pid_exists(first["child"])
        second = _serving(base)
        assert second["plan"] == "no-draft"
        assert json.loads(state_path(f).read_text())["pid"] == second["pid"]
        switch_to(f, "draft-k3", 120)  # and back: a server started again
        third = _serving(base)
        assert third["plan"] == "draft-k3" and not psutil.pid_exists(second["child"])
        with pytest.raises(BadInput, match="no plan 'draft-k9'.*prepared: broken, draft-k3, no-draft"):
            switch_to(f, "draft-k9", 10)
    finally:
        out = _stop(sidecar)
    # SIGTERM, the pod ending: the server's whole group is stopped with the sidecar
    assert sidecar.returncode == 128 + signal.SIGTERM, out
    assert "serving plan no-draft" in out
    assert not psutil.pid_exists(third["pid"]) and not psutil.pid_exists(third["child"])


def test_a_server_that_ends_on_its_own_ends_the_sidecar_and_the_restart_serves_the_request_again(prepared):
    """As an exec'd `vllm serve` would: the exit code is the server's, the kubelet restarts the sidecar
    (restartPolicy: Always) and it starts the plan the worker last asked for, not the first."""
    f, base = prepared
    sidecar = _sidecar(f)
    try:
        switch_to(f, "no-draft", 120)
        serving = _serving(base)
        os.kill(serving["pid"], signal.SIGKILL)  # a crash: the server dies, its child with it (its group)
        sidecar.wait(120)
        assert sidecar.returncode == 128 + signal.SIGKILL
        assert not psutil.pid_exists(serving["child"])
    finally:
        _stop(sidecar)
    restarted = _sidecar(f)
    try:
        assert _serving(base)["plan"] == "no-draft"
        with pytest.raises(subprocess.TimeoutExpired):
            restarted.wait(2)
    finally:
        _stop(restarted)
    # a plan whose server exits at once (exit 7): the sidecar exits 7 once the worker asked for it
    sidecar = _sidecar(f)
    try:
        _serving(base)
        switch_to(f, "broken", 120)
        sidecar.wait(120)
        assert sidecar.returncode == 7
    finally:
        _stop(sidecar)


def test_one_plan_is_execd_and_a_missing_file_is_one_line(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    f = tmp_path / "one.json"
    PreparedPlans({"capture": {"argv": [sys.executable, str(script), str(port), "capture", "-"], "env": {}}},
                  "capture").write(f)
    sidecar = _sidecar(f, subprocess.DEVNULL)
    try:
        served = _serving(f"http://127.0.0.1:{port}")
        assert served["pid"] == sidecar.pid  # exec'd: the sidecar is the server
        switch_to(f, "anything", 1)  # one plan: nothing to switch
    finally:
        _stop(sidecar)
        os.kill(served["child"], signal.SIGKILL)  # no group stop without a supervisor: vLLM's own SIGTERM does it
    out = subprocess.run([EAGLE_JOBS, "exec-vllm", str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert out.returncode == 3 and "nope.json not found: the prepare init container writes it" in out.stderr
