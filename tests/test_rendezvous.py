"""Multi-node training's rendezvous as k8s/overlays/full-multinode renders it, run on two CPU processes.

The JobSet starts the train pods independently: one may wait minutes for a node or an image pull
while the other is up. torch's c10d rendezvous decides who hosts its store from the endpoint's
hostname unless `is_host` says so, and a non-host agent gives up connecting after `read_timeout`
(60 s by default) plus one retry (src/eagle_jobs/rendezvous.py cites the lines). The arguments
eeb302c rendered (`--nnodes 2 --node_rank 1 --rdzv_backend c10d --rdzv_endpoint <pod-0>:29500`, no
--rdzv-conf) make pod 1 a client that way: measured by hand on this machine (torch 2.13), with pod 0
never coming up, pod 1's torchrun exited 1 after 152 s with "RendezvousConnectionError: The
connection to the C10d store has failed" (socket.cpp: "The client socket has timed out after
60000ms"; TCPStore.cpp retried once after a 47.9 s jittered backoff). The delayed test below runs
those arguments beside the rendered ones and starts pod 0 only after they have failed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, kustomize

from eagle_jobs.errors import BadInput
from eagle_jobs.rendezvous import torchrun_rendezvous_args

REPO = Path(__file__).resolve().parents[1]
ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def _train_env() -> dict[str, str]:
    """The train worker's literal env in the rendered full-multinode overlay."""
    (js,) = [d for d in kustomize(REPO / "k8s/overlays/full-multinode") if d["kind"] == "JobSet"]
    (train,) = [rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == "train"]
    worker = train["template"]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in worker["env"] if "value" in e}


def test_the_rendered_pods_host_the_store_on_pod_0_and_wait_half_an_hour():
    env = _train_env()
    nnodes = int(env["EAGLE_JOBS_NNODES"])
    assert nnodes == 2
    args = {i: torchrun_rendezvous_args(nnodes, {**env, "JOB_COMPLETION_INDEX": str(i)}) for i in range(nnodes)}
    for i, a in args.items():
        assert a[a.index("--rdzv-backend") + 1] == "c10d"
        assert a[a.index("--rdzv-endpoint") + 1] == "$(JOBSET_NAME)-train-0-0.$(JOBSET_NAME):29500"
        conf = dict(kv.split("=") for kv in a[a.index("--rdzv-conf") + 1].split(","))
        assert conf == {"is_host": "true" if i == 0 else "false", "read_timeout": "1800", "join_timeout": "1800"}
        assert "--node_rank" not in a and "--node-rank" not in a  # c10d ignores it (run.py config_from_args)
    # between nodes NCCL may use InfiniBand; blackwell-8gpu's single-node stages keep it off
    assert env["NCCL_IB_DISABLE"] == "0"
    assert torchrun_rendezvous_args(1, {}) == ["--standalone"]


@pytest.mark.parametrize("env,what", [
    ({"JOB_COMPLETION_INDEX": "0"}, "EAGLE_JOBS_RDZV_ENDPOINT is not set"),
    ({"EAGLE_JOBS_RDZV_ENDPOINT": "h:29500"}, "JOB_COMPLETION_INDEX is ''"),
    ({"EAGLE_JOBS_RDZV_ENDPOINT": "h:29500", "JOB_COMPLETION_INDEX": "0", "EAGLE_JOBS_RDZV_TIMEOUT_S": "30m"},
     "EAGLE_JOBS_RDZV_TIMEOUT_S is '30m'"),
])
def test_a_pod_without_what_the_rendezvous_needs_is_refused_in_one_line(env, what):
    with pytest.raises(BadInput, match=re.escape(what)):
        torchrun_rendezvous_args(2, env)


def test_the_train_launcher_passes_exactly_these_arguments(monkeypatch, tmp_path):
    """run_ranks (the pod's `eagle-jobs train`) hands torchrun what torchrun_rendezvous_args renders."""
    from eagle_jobs.errors import EagleJobsError
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.store import Store
    from eagle_jobs.train import launch

    seen = []

    class NoTorchrun:
        def __init__(self, cmd, **_kw):
            seen.append(cmd)

        def wait(self):
            return 1

    env = {**_train_env(), "JOB_COMPLETION_INDEX": "1", "EAGLE_JOBS_RDZV_ENDPOINT": "pod-0.js:29500"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launch.subprocess, "Popen", NoTorchrun)
    recipe = load_recipe(REPO / "jobs/kimi-k2.5.yaml")
    with pytest.raises(EagleJobsError):
        launch.run_ranks(recipe, Store.open(f"file://{tmp_path}/s"), "r", None, tmp_path / "w", launch.Ranks(8, 2))
    (cmd,) = seen
    rdzv = torchrun_rendezvous_args(2, env)
    start = cmd.index("torch.distributed.run") + 1
    assert cmd[start:start + len(rdzv)] == rdzv
    # the SIGTERM drain window, which this torch's real torchrun parser accepts (torch 2.11's had no such flag;
    # make venv installs torch 2.13.0 (Makefile TORCH_SPEC), as the train image does, which has it)
    assert launch.torchrun_has_shutdown_timeout()
    assert cmd[cmd.index("--shutdown_timeout") + 1] == str(launch.RANK_SHUTDOWN_TIMEOUT_S)
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(cmd[start:cmd.index("-m", start)] + ["x"])
    assert parsed.shutdown_timeout == launch.RANK_SHUTDOWN_TIMEOUT_S


def test_a_torchrun_without_shutdown_timeout_gets_no_such_flag(monkeypatch, tmp_path, capsys):
    """torch 2.11's torchrun (a GPU machine's image may carry it) exits 2 on --shutdown_timeout: the launcher
    leaves it out, and says what that costs."""
    import torch.distributed.run as torchrun

    from eagle_jobs.errors import EagleJobsError
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.store import Store
    from eagle_jobs.train import launch

    real = torchrun.get_args_parser

    def parser_of_an_older_torch():
        p = real()
        p._actions = [a for a in p._actions if "--shutdown_timeout" not in a.option_strings]
        return p

    monkeypatch.setattr(torchrun, "get_args_parser", parser_of_an_older_torch)
    seen = []
    monkeypatch.setattr(launch.subprocess, "Popen",
                        lambda cmd, **kw: seen.append(cmd) or type("P", (), {"wait": lambda s: 1})())
    recipe = load_recipe(REPO / "jobs/kimi-k2.5.yaml")
    with pytest.raises(EagleJobsError):
        launch.run_ranks(recipe, Store.open(f"file://{tmp_path}/s"), "r", None, tmp_path / "w", launch.Ranks(1))
    assert "--shutdown_timeout" not in seen[0] and "no --shutdown_timeout" in capsys.readouterr().err


def _torchrun(args: list[str], prog: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "--nproc_per_node", "1", str(prog)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _rendered(index: int, env: dict) -> list[str]:
    return torchrun_rendezvous_args(int(env["EAGLE_JOBS_NNODES"]), {**env, "JOB_COMPLETION_INDEX": str(index)})


def test_a_worker_that_starts_long_before_pod_0_still_trains(tmp_path):
    """Pod 1 is up long before pod 0 (pod 0 waited for a node, or pulled its image). eeb302c's pod 1
    gives up first; the rendered pod 1, started at the same moment, is still waiting when pod 0
    finally starts, and the two all-reduce."""
    # both "pods" are this machine: pod 0's headless-Service name becomes loopback, each on a free port
    env = {**_train_env(), "EAGLE_JOBS_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    # eeb302c's pod 1; is_host=false is what torch's hostname match answers on pod 1 (its name is not pod 0's)
    old_args = ["--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "is_host=false"]
    prog = tmp_path / "all_reduce.py"
    prog.write_text(ALL_REDUCE)
    t0 = time.monotonic()
    old = _torchrun(old_args, prog, tmp_path / "old-pod1.log")
    early = _torchrun(_rendered(1, env), prog, tmp_path / "pod1.log")
    assert old.wait(timeout=300) != 0
    gave_up_after = time.monotonic() - t0
    old_log = (tmp_path / "old-pod1.log").read_text()
    assert "RendezvousConnectionError" in old_log and gave_up_after > 60, old_log[-3000:]
    assert early.poll() is None, (tmp_path / "pod1.log").read_text()[-3000:]  # still waiting for pod 0's store
    late = _torchrun(_rendered(0, env), prog, tmp_path / "pod0.log")
    codes = [late.wait(timeout=120), early.wait(timeout=120)]
    logs = (tmp_path / "pod0.log").read_text() + (tmp_path / "pod1.log").read_text()
    assert codes == [0, 0], logs[-4000:]
    assert sorted(re.findall(r"rank (\d) of 2: sum 3", logs)) == ["0", "1"], logs[-4000:]
