"""A pod's vLLM sidecar that serves one of several prepared `vllm serve` plans at a time, chosen by its worker.

evaluate needs more than one server: the trained draft at each k of `evaluate.num_speculative_tokens`, an
untrained draft (the τ baseline) and the verifier without a draft (the speed baseline). vLLM fixes
speculative decoding per engine (VllmConfig.speculative_config, built once from --speculative-config), so
each is a process of its own. In a pod only the sidecar may run them: it holds the GPUs and runs the
verifier's own code with the store's read-only key, while the worker requests no GPU.

So the prepare init container (`eagle-jobs serve-vllm --write F`) writes every plan of the stage into F
(`PreparedPlans`), and the sidecar (`eagle-jobs exec-vllm F`) runs them one at a time (`supervise`):
- it starts the plan the worker last asked for (F.request.json), or the first plan;
- the worker asks for another by name (`switch_to`), never by command: the sidecar runs only what prepare wrote;
- the sidecar stops the running server (SIGTERM; SIGKILL to its process group after a grace), waits until
  every process of that group is gone, so its GPU memory is free, then writes F.state.json naming the
  request and starts the next plan. The worker waits for that state, then for /health: whatever answers
  /health after the state names its request is the server it asked for;
- a server that exits on its own ends the sidecar with its exit code, as an exec'd `vllm serve` would: the
  kubelet restarts the sidecar, which starts the requested plan again, and the run's guard fails the run
  on the third exit (eagle_jobs.cluster.guard);
- SIGTERM (the pod ending) stops the server and ends the sidecar.
A file of one plan (capture, extract) is exec'd as it is: nothing to switch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from eagle_jobs.errors import BadInput, Unavailable
from eagle_jobs.vllm_guard import GUARD_GRACE_S, die_with_parent, executable
from eagle_jobs.vllm_guard import stop as stop_server

GONE_WAIT_S = 60.0  # then a process group still alive after SIGKILL is a fault (an unkillable D-state process)
LOOK_EVERY_S = 0.5


@dataclass(frozen=True)
class PreparedPlans:
    """What prepare wrote: each plan's argv and environment by name, and the one to start with."""

    plans: dict[str, dict]
    first: str

    def write(self, path: Path) -> None:
        _write_json(path, {"first": self.first, "plans": self.plans})  # the sidecar never reads half of it

    @classmethod
    def read(cls, path: Path) -> PreparedPlans:
        if not path.is_file():
            raise BadInput(f"exec-vllm: {path} not found: the prepare init container writes it "
                           "(serve-vllm --write); check the pod's initContainers")
        data = json.loads(path.read_text())
        return cls(plans=data["plans"], first=data["first"])


def request_path(plans: Path) -> Path:
    return plans.with_name(plans.stem + ".request.json")


def state_path(plans: Path) -> Path:
    return plans.with_name(plans.stem + ".state.json")


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # not yet written (os.replace makes it whole when it is)
        return None


# -- the sidecar ------------------------------------------------------------------------------------
def _resolved(plan: dict) -> tuple[str, list[str], dict[str, str]]:
    """The plan's executable, argv and environment, as the sidecar runs it."""
    argv = list(plan["argv"])
    exe = executable(argv[0])
    if exe is None:
        raise Unavailable("vllm is not installed in this image: the vLLM sidecar runs it")
    return exe, argv, {**os.environ, **plan["env"]}


def exec_plan(plan: dict) -> None:
    """Become the plan's `vllm serve` (a file of one plan, or `serve-vllm` without --write)."""
    exe, argv, env = _resolved(plan)
    os.execve(exe, argv, env)


def _start(plan: dict) -> subprocess.Popen:
    exe, argv, env = _resolved(plan)
    return subprocess.Popen([exe, *argv[1:]], env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True,  # its own process group: stopped as one
                            preexec_fn=die_with_parent)  # noqa: PLW1509 - the sidecar starts no threads


def _stop(server: subprocess.Popen, grace_s: float) -> None:
    """Stop the server and wait until no process of its group is left (their GPU memory is then free).
    In a container the sidecar is PID 1: orphans of the group become its children, reaped here."""
    stop_server(server, grace_s)
    server.wait()
    deadline = time.monotonic() + GONE_WAIT_S
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise Unavailable(f"vllm serve (process group {server.pid}) still has processes {GONE_WAIT_S:.0f} s after "
                      "SIGKILL: the node's GPU driver or a D-state process holds them")


def supervise(plans_file: Path, grace_s: float = GUARD_GRACE_S) -> int:
    """Serve the requested plan until the pod ends; the exit code of a server that ends on its own."""
    prepared = PreparedPlans.read(plans_file)
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    request = _read_json(request_path(plans_file)) or {"plan": prepared.first, "id": None}
    while not stopping:
        name = request["plan"]
        if name not in prepared.plans:
            _write_json(state_path(plans_file), {"id": request["id"], "plan": name,
                                                 "error": f"no plan {name!r} in {plans_file}: it has "
                                                          f"{', '.join(sorted(prepared.plans))}"})
            request = _next_request(plans_file, request, lambda: bool(stopping)) or request
            continue
        server = _start(prepared.plans[name])
        _write_json(state_path(plans_file), {"id": request["id"], "plan": name, "pid": server.pid})
        print(f"eagle-jobs exec-vllm: serving plan {name} (pid {server.pid})", file=sys.stderr, flush=True)
        new = _next_request(plans_file, request, lambda s=server: bool(stopping) or s.poll() is not None)
        _stop(server, grace_s)
        if new is None and not stopping:  # the server ended on its own
            return server.returncode if server.returncode >= 0 else 128 - server.returncode
        request = new or request
    return 128 + signal.SIGTERM


def _next_request(plans_file: Path, current: dict, done) -> dict | None:
    """The first request with another id than `current`'s, or None once done() is true."""
    while not done():
        new = _read_json(request_path(plans_file))
        if new is not None and new.get("id") != current["id"]:
            return new
        time.sleep(LOOK_EVERY_S)
    return None


# -- the worker -------------------------------------------------------------------------------------
def switch_to(plans_file: Path, name: str, timeout_s: float) -> None:
    """Make the sidecar serve plan `name`, then return (its /health is the caller's to wait for).
    A no-op when it already serves it, or when prepare wrote one plan (nothing to switch)."""
    from eagle_jobs.poll import poll_until
    from eagle_jobs.progress import console

    prepared = PreparedPlans.read(plans_file)
    if len(prepared.plans) == 1:
        return
    if name not in prepared.plans:
        raise BadInput(f"the vLLM sidecar has no plan {name!r} (prepared: {', '.join(sorted(prepared.plans))}): "
                       "prepare and the worker read different recipes")
    state = _read_json(state_path(plans_file)) or {}
    if state.get("plan") == name and "error" not in state:
        return
    want = uuid.uuid4().hex
    _write_json(request_path(plans_file), {"plan": name, "id": want})
    console.print(f"  vLLM sidecar: switching to plan {name}", soft_wrap=True, markup=False, highlight=False)
    deadline = time.monotonic() + timeout_s

    def failed() -> None:
        if time.monotonic() > deadline:
            raise Unavailable(f"the vLLM sidecar did not take up plan {name} within {timeout_s:.0f} s: "
                              "see the vllm container's log")

    def answered() -> dict | None:
        s = _read_json(state_path(plans_file))
        if s is not None and s.get("id") == want:
            if "error" in s:
                raise BadInput(f"the vLLM sidecar: {s['error']}")
            return s
        return None

    poll_until(answered, failed=failed, every_s=LOOK_EVERY_S, report_s=60)
