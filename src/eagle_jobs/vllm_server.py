"""A vLLM OpenAI-compatible server for the `vllm` backends: external, or started here.

Without an endpoint (the pod's sidecar, or one in the recipe) a stage runs `vllm serve` itself,
under eagle_jobs.vllm_guard, which stops the server and every process vLLM started when the stage
ends, SIGKILL included. The server's own output goes to a log file (its path printed once, its last
lines printed when it fails); /health is polled with a deadline long enough for a 1T-parameter load.
A stage talks only to the server it started (on a free port, and answering from its own process
group) or to the endpoint it was given, and only once /v1/models names the recipe's verifier.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from eagle_jobs import vllm_cpu
from eagle_jobs.errors import BadInput, Unavailable
from eagle_jobs.poll import poll_until
from eagle_jobs.progress import console
from eagle_jobs.recipe import VerifierSpec, VllmServerSpec
from eagle_jobs.settings import settings
from eagle_jobs.vllm_guard import GUARD_GRACE_S, executable

HEALTH_EVERY_S = 2.0  # between /health looks while a server loads


def wait_healthy(base: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until base/health answers 200, for at most timeout_s (the stage's vllm.health_timeout_s), beating the
    heartbeat: in a pod the worker starts beside its vLLM sidecar (no startup probe holds it back), and this
    deadline, not the heartbeat's 30 minutes, is what a load of the verifier gets."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"

    def healthy() -> bool | None:
        nonlocal last
        try:
            r = httpx.get(f"{base}/health", timeout=5)
            if r.status_code == 200:
                return True
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        return None

    def failed() -> None:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"vllm serve exited with code {proc.returncode} before {base}/health answered")
        if time.monotonic() >= deadline:
            raise Unavailable(f"server {base} not healthy after {timeout_s:.0f}s ({last}): check the server log, "
                              "or raise health_timeout_s in the recipe")

    poll_until(healthy, failed=failed, every_s=HEALTH_EVERY_S, report_s=math.inf)


@dataclass(frozen=True)
class ServePlan:
    """One stage's `vllm serve`: the recipe's server section, the verifier, and the arguments the stage
    adds. eagle_jobs.serve_plans builds every stage's plan; the stage's own subprocess
    (vllm_endpoint) and the pod's sidecar (`eagle-jobs serve-vllm`) both run exactly this."""

    spec: VllmServerSpec
    verifier: VerifierSpec
    stage_args: tuple[str, ...] = ()
    name: str = ""  # how a pod's worker asks its sidecar for this server (eagle_jobs.vllm_switch)

    def command(self) -> list[str]:
        return serve_command(self.spec, self.verifier, list(self.stage_args))

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        return serve_env(self.verifier, dict(base))

    def on_port(self, port: int) -> ServePlan:
        return replace(self, spec=self.spec.model_copy(update={"port": port}))


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


# vLLM 0.32 stops its engine core with the API server's --shutdown-timeout (default 0: at once, by
# SIGKILL, vllm/v1/utils.py shutdown()), so the engine never unlinks its shared memory and the
# server's resource tracker warns of "2 leaked shared_memory objects" at exit. With a timeout the
# engine drains what is in flight, then stops its workers in order (up to 5 + 4 s of their own grace,
# vllm/v1/executor/multiproc_executor.py): 15 s on 2 idle cores, over 10 s on busy ones.
SHUTDOWN_TIMEOUT_S = 30
LOG_TAIL_LINES = 30


def with_shutdown_timeout(cmd: list[str]) -> list[str]:
    """The command with SHUTDOWN_TIMEOUT_S, where it gives none: for a server that is stopped and started again."""
    return cmd if "--shutdown-timeout" in cmd else [*cmd, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]


def server_log(run_id: str | None, name: str) -> Path:
    """A stage's own server writes here: <work dir>/<run id>/logs/vllm-<name>.log, beside train's work
    dir (EAGLE_JOBS_WORK_DIR, default ~/.cache/eagle-jobs/work), appended to by every attempt."""
    root = settings().work_root()
    return root / (run_id or "servers") / "logs" / f"vllm-{name}.log"


@contextmanager
def vllm_endpoint(plan: ServePlan, log: Path | None = None):
    """Yields the base URL (http://host:port) of a healthy server that serves the verifier.

    An endpoint from the recipe or $EAGLE_JOBS_VLLM_ENDPOINT (the pod's vLLM sidecar) is used as it
    is; otherwise `vllm serve` runs here, its output in `log` (default: server_log(None, <port>)).
    """
    spec, verifier = plan.spec, plan.verifier
    endpoint = spec.endpoint or settings().vllm_endpoint
    if endpoint:
        base = endpoint.rstrip("/").removesuffix("/v1")
        prepared = settings().vllm_plans
        if prepared is not None and plan.name:  # a sidecar of several plans: ask it for this one
            from eagle_jobs.vllm_switch import switch_to

            switch_to(prepared, plan.name, spec.health_timeout_s)
        wait_healthy(base, spec.health_timeout_s)
        cmd = plan.command()  # what the sidecar runs: the same plan
        check_served_model(base, {served_model_id(cmd), verifier.model}, given=True)
        yield base
        return
    exe = executable("vllm")
    if exe is None:
        raise Unavailable("vllm is not installed here: run `make venv` (vllm-cpu), set <stage>.vllm.endpoint "
                          "in the recipe, or use the GPU image")
    port = free_port_for(spec)
    cmd = with_shutdown_timeout(plan.on_port(port).command())
    log = log or server_log(None, f"port-{spec.port}")
    with _guarded(exe, cmd, plan.env(os.environ), log) as guard:
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, spec.health_timeout_s, guard)
            check_listener(port, guard)
            check_served_model(base, {served_model_id(cmd)}, given=False)
            yield base
        except Exception as e:
            if isinstance(e, Unavailable) or guard.poll() is not None:
                print_tail(log)
            raise


def free_port_for(spec: VllmServerSpec) -> int:
    """spec.port, or a free one (said in one line) when something else listens there: a stage never
    talks to a server it did not start, such as one an earlier, killed run left behind."""
    host = _last_flag(spec.serve_args, "--host") or "0.0.0.0"
    if not _port_taken(host, spec.port):
        return spec.port
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    console.print(f"  port {spec.port} is taken ({_listener_names(spec.port) or 'by another process'}): "
                  f"this stage's vLLM server uses port {port}", soft_wrap=True, markup=False, highlight=False)
    return port


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listener_pids(port: int) -> set[int]:
    """Processes listening on the port, as far as this user may see (psutil reads /proc)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}


def _listener_names(port: int) -> str:
    import psutil

    names = []
    for pid in sorted(_listener_pids(port)):
        try:
            names.append(f"pid {pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.Error:
            names.append(f"pid {pid}")
    return "; ".join(names)


def check_listener(port: int, guard: subprocess.Popen) -> None:
    """The process answering on the port is one of ours, not a stranger that got there first."""
    import psutil

    pids = _listener_pids(port)
    try:
        ours = {p.pid for p in psutil.Process(guard.pid).children(recursive=True)}
    except psutil.Error:
        ours = set()
    if pids and not pids & ours:
        raise Unavailable(f"port {port} answers, but not from the vLLM server this stage started "
                          f"({_listener_names(port)}): stop that process or set another <stage>.vllm.port")


def served_model_id(cmd: list[str]) -> str:
    """The model id `vllm serve` answers to: --served-model-name, else the model argument."""
    return _last_flag(cmd, "--served-model-name") or cmd[2]


def check_served_model(base: str, expected: set[str], given: bool) -> None:
    """Before the first request: GET /v1/models must name the verifier."""
    try:
        r = httpx.get(f"{base}/v1/models", timeout=30)
        served = [m["id"] for m in r.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise Unavailable(f"{base}/v1/models: no model list ({type(e).__name__}): is this a vLLM server?") from None
    if not set(served) & expected:
        msg = (f"{base} serves {', '.join(served) or 'no model'}, "
               f"not this recipe's verifier ({', '.join(sorted(expected))})")
        if given:
            raise BadInput(f"{msg}: point <stage>.vllm.endpoint (or $EAGLE_JOBS_VLLM_ENDPOINT) at a server of it")
        raise Unavailable(f"{msg}: another server answered on this stage's port")


def _last_flag(args: list[str], name: str) -> str | None:
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    values += [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return values[-1] if values else None


@contextmanager
def _guarded(exe: str, cmd: list[str], env: dict[str, str], log: Path):
    """`vllm serve` under eagle_jobs.vllm_guard, output appended to `log`; stopped on the way out.

    The guard reads a pipe only this process writes to, so it sees end-of-file however this process
    ends (SIGKILL included) and then stops the server and everything it started."""
    log.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"  vLLM server log: {log}", soft_wrap=True, markup=False, highlight=False)
    read_end, write_end = os.pipe()  # both non-inheritable: only the guard's stdin holds the read end
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        out.flush()
        guard_cmd = [sys.executable, "-m", "eagle_jobs.vllm_guard", str(GUARD_GRACE_S), "--", exe, *cmd[1:]]
        guard = subprocess.Popen(guard_cmd, stdin=read_end, stdout=out, stderr=out, env=env, start_new_session=True)
    os.close(read_end)
    try:
        yield guard
    finally:
        os.close(write_end)  # the guard's signal to stop the server
        try:
            guard.wait(timeout=GUARD_GRACE_S + 30)
        except subprocess.TimeoutExpired:
            os.killpg(guard.pid, signal.SIGKILL)
            guard.wait()


def print_tail(log: Path, lines: int = LOG_TAIL_LINES) -> None:
    """The server's last lines, where the stage's own failure line will follow."""
    try:
        with open(log, errors="replace") as f:
            tail = list(deque(f, maxlen=lines))
    except OSError:
        return
    console.print(f"  vLLM server log, last {len(tail)} lines ({log}):", soft_wrap=True, markup=False, highlight=False)
    for line in tail:
        console.print(f"  | {line.rstrip()}", soft_wrap=True, markup=False, highlight=False)


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
