"""The vLLM stages' progress heartbeat, instead of a wall-clock deadline that also counts waiting.

activeDeadlineSeconds cannot tell a slow stage from a stuck one, and it counts the wait for a node,
the image pull and up to 90 minutes of model load; a deadline restart pays that load again. So the
worker of capture, extract and evaluate touches a file each time it makes progress (a stage starts,
a conversation is captured, a row extracted, a prompt evaluated: progress.stage_progress), and the
kubelet runs `python3 -m eagle_jobs.heartbeat <file> <max-age-s>` as the worker's startup and
liveness probe (k8s/components/vllm-sidecar). A worker or vLLM that stops making progress fails its
pod about half an hour after its last progress, however long the stage is.

Imports nothing heavy: the probe runs every minute in the worker's container.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "EAGLE_JOBS_HEARTBEAT"  # the file; unset (outside a pod) means no heartbeat
EVERY_S = 5.0  # at most one write this often: progress ticks for every row
_last = float("-inf")


def beat(force: bool = False) -> None:
    """Touch the heartbeat file, if there is one, at most every EVERY_S seconds. The environment is read at
    most that often too, set or not: beat() runs on every progress tick and every look of a wait."""
    global _last
    now = time.monotonic()
    if not force and now - _last < EVERY_S:
        return
    _last = now
    from eagle_jobs.settings import settings  # here: the probe (`python3 -m eagle_jobs.heartbeat`) stays stdlib-only

    path = settings().heartbeat  # ENV
    if path is None:
        return
    with open(path, "a"):
        pass
    os.utime(path)


def check(path: str, max_age_s: float) -> str | None:
    """None when `path` was touched within max_age_s; else why not, in one line."""
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return f"heartbeat: no {path} yet: the worker has made no progress since it started"
    if age > max_age_s:
        return f"heartbeat: {path} is {age:.0f} s old (> {max_age_s:.0f} s): no progress; the worker or vLLM is stuck"
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python3 -m eagle_jobs.heartbeat <file> <max-age-seconds>", file=sys.stderr)
        return 2
    problem = check(args[0], float(args[1]))
    if problem:
        print(problem)  # the kubelet puts a failed probe's output in the pod's Unhealthy event
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
