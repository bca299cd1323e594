"""One way to wait on another process: look again until something is ready.

Between looks `poll_until` calls `failed` (which raises when the wait can never end: the other side failed or
finished without the thing waited for), beats the heartbeat (a wait on the pipeline's other side is progress,
so a pod's liveness probe does not kill a worker that waits on a slow peer: eagle_jobs/heartbeat.py), and calls
`say` with the seconds waited, on the first wait and then every `report_s`. Every wait of a stage's
process uses it: extraction on a full window, training on a shard, on extraction's first shard and on the
shards it stages, a stage on its vLLM server's /health (a load of the verifier beats: its own deadline,
health_timeout_s, bounds it), and extraction on vLLM's hidden-states file lock, which does not beat
(`progress=False`): a writer stuck holding it is what the liveness probe is there to catch.
Two loops are not such waits and do not use it: the vLLM sidecar's (eagle_jobs.vllm_switch), which runs
beside the worker and must not beat the worker's heartbeat, and `eagle-jobs watch`, which follows a
cluster's run from outside it.

Imports nothing heavy: speculators' spawned loader workers wait through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from eagle_jobs.heartbeat import beat

T = TypeVar("T")


def poll_until(ready: Callable[[], T | None], say: Callable[[float], None] | None = None,
               failed: Callable[[], None] | None = None, *, every_s: float, report_s: float,
               progress: bool = True) -> T:
    """ready()'s first value that is not None, looking every `every_s` seconds. progress=False: the wait is
    on the stage's own server, which the heartbeat exists to catch stuck, so it does not beat."""
    started, last = time.monotonic(), None
    while (value := ready()) is None:
        if failed is not None:
            failed()
        if progress:
            beat()
        now = time.monotonic()
        if say is not None and (last is None or now - last >= report_s):
            say(now - started)
            last = now
        time.sleep(every_s)
    return value
