"""The watchdog between a stage and the `vllm serve` it starts: the server lives and dies with the stage.

`python -m eagle_jobs.vllm_guard GRACE_S -- vllm serve ...`, started by eagle_jobs.vllm_server in a
session of its own. Its stdin is a pipe whose only writer is the stage, so end-of-file means the stage
ended, however it ended: a return, an exception, SIGTERM, SIGKILL, the OOM killer. The guard then stops
the server: SIGTERM to `vllm serve`, which stops its engine core and workers in order (they share shared
memory that only an orderly stop unlinks), and after GRACE_S seconds SIGKILL to the server's whole
process group, which holds everything vLLM forked or spawned (vLLM 0.32's engine core is a
multiprocessing child of the API server, its workers children of that, none in a session of its own).
The guard does the same when `vllm serve` exits on its own, so an engine core never outlives its API
server, and exits with the server's code. `vllm serve` also gets a parent-death signal (Linux
prctl PR_SET_PDEATHSIG): if the guard itself is killed, the server is told to stop.

Standard library only, and no threads (PR_SET_PDEATHSIG fires when the creating thread ends): it stays
small while the server runs.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GUARD_GRACE_S = 90.0  # SIGTERM, then SIGKILL to what is left of the server's process group


def executable(name: str) -> str | None:
    """On PATH, else beside this Python (a venv's bin/, which `make venv` fills, need not be on PATH)."""
    found = shutil.which(name)
    beside = Path(sys.executable).parent / name
    return found or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


def die_with_parent() -> None:
    """In the child between fork and exec: SIGTERM when its parent (the guard, the sidecar) dies; Linux only."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop(server: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the API server, then SIGKILL to its process group: what is left of the engine."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # its group outlives it while any member lives
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    grace_s, sep, *cmd = argv
    assert sep == "--" and cmd, "usage: python -m eagle_jobs.vllm_guard GRACE_S -- vllm serve ..."
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the stage's to handle
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True,
                              preexec_fn=die_with_parent)  # noqa: PLW1509 - safe: the guard has no threads
    stage = sys.stdin.fileno()
    while server.poll() is None and not stopping:
        try:
            ready, _, _ = select.select([stage], [], [], 0.5)
        except InterruptedError:
            continue
        if ready and not os.read(stage, 4096):  # end of file: the stage is gone
            break
    started = time.monotonic()
    stop(server, float(grace_s))
    print(f"eagle-jobs vllm_guard: server stopped (exit {server.poll()}) in {time.monotonic() - started:.1f}s",
          file=sys.stderr, flush=True)
    return server.returncode if server.returncode is not None and server.returncode >= 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
