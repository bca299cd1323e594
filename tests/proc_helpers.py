"""Helpers for the tests that run eagle-jobs in processes of its own: the installed console script, the
processes a run's marker finds (tests/test_exit_paths.py, tests/test_stream.py), and a training pod
stopped and watched as tests/test_resume.py stops and watches it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# -- the `eagle-jobs` console script, as a user runs it (tests/test_cli_errors.py) ---------------------------
EAGLE_JOBS = str(Path(sys.executable).parent / "eagle-jobs")


def run_cli(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EAGLE_JOBS, *args], capture_output=True, text=True, timeout=300,
                          env=env or dict(os.environ), cwd=cwd)


def one_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


# -- the processes of a run, found by the marker in their environment (tests/test_exit_paths.py) -------------
MARK = "EAGLE_JOBS_TEST_EXIT_PATH"


def marked(mark: str) -> list[psutil.Process]:
    """Every live process whose environment carries this marker: the stage, its guard, the server and
    whatever the server forked or spawned (they inherit the environment)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def wait_gone(mark: str, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


# -- a training pod, killed and watched (tests/test_resume.py) -----------------------------------------------
def kill_pod(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of the pod at once, as a lost node or the OOM killer of a cgroup: the
    launcher, torchrun and the ranks (torchrun starts each rank in a session of its own)."""
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


def read_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line a kill cut short
            break
    return out


def wait_for(proc: subprocess.Popen, log: Path, what: str, ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"pod ended ({proc.returncode}) before {what}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s: {log.read_text()[-3000:]}"
        time.sleep(0.02)
