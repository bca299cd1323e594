"""A new user's first mistakes end in one line and a documented exit code, never a traceback.

Each case runs the installed `eagle-jobs` console script in its own process, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from conftest import REPO
from eagle_jobs.cli import app
from eagle_jobs.errors import ExitCode

EAGLE_JOBS = str(Path(sys.executable).parent / "eagle-jobs")
COMMANDS = sorted(typer.main.get_command(app).commands)
CLUSTER = {  # every command that talks to a cluster, with arguments that get it that far
    "submit": ["--overlay", str(REPO / "k8s/overlays/dev"), "--run-id", "demo"],
    "status": ["demo"],
    "watch": ["demo", "--timeout", "1"],
    "logs": ["demo"],
}


def run_cli(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EAGLE_JOBS, *args], capture_output=True, text=True, timeout=300,
                          env=env or dict(os.environ), cwd=cwd)


def one_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_every_command_is_covered():
    assert set(CLUSTER) <= set(COMMANDS) and len(COMMANDS) >= 16


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_option_is_one_line_and_exit_2(command):
    out = run_cli([command, "--bogus"])
    line = one_line(out)
    assert out.returncode == ExitCode.USAGE
    assert "No such option: --bogus" in line and f"try 'eagle-jobs {command} --help'" in line
    assert f"usage: eagle-jobs {command} [OPTIONS]" in line


@pytest.mark.parametrize("args, what", [
    (["status"], "Missing argument 'run_id'"),  # a missing argument
    (["capture"], "Missing option '--recipe'"),  # a missing required option
    (["capture", "--recipe", "jobs/demo.yaml", "--shard-index", "two"], "Invalid value for '--shard-index'"),
    (["status", "--run-id", "demo"], "No such option: --run-id"),  # the example: an argument there
    (["captur"], "No such command 'captur'"),
])
def test_usage_errors_are_one_line_and_exit_2(args, what):
    out = run_cli(args)
    assert what in one_line(out) and out.returncode == ExitCode.USAGE


def test_no_command_prints_the_help_and_no_traceback():
    out = run_cli([])
    assert "Traceback" not in out.stdout + out.stderr and "capture" in out.stdout + out.stderr
    assert out.returncode == ExitCode.USAGE


@pytest.fixture
def no_cluster_env(tmp_path) -> dict[str, str]:
    """No kubeconfig anywhere (HOME and KUBECONFIG at empty directories) and not inside a pod."""
    (tmp_path / "home").mkdir()
    (tmp_path / "kube").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    return {**env, "HOME": str(tmp_path / "home"), "KUBECONFIG": str(tmp_path / "kube")}


@pytest.mark.parametrize("command", sorted(CLUSTER))
def test_a_cluster_command_without_configuration_names_what_it_tried(command, no_cluster_env, tmp_path):
    out = run_cli([command, *CLUSTER[command]], env=no_cluster_env, cwd=REPO)
    line = one_line(out)
    assert out.returncode == ExitCode.NO_CLUSTER == 8
    assert line.startswith("eagle-jobs: error: no cluster configuration")
    assert "--kubeconfig: not given" in line and f"$KUBECONFIG {tmp_path / 'kube'}" in line
    assert "in-cluster: Service host/port is not set." in line


@pytest.mark.parametrize("command", sorted(CLUSTER))
def test_without_kubeconfig_the_default_file_is_tried(command, no_cluster_env):
    env = {k: v for k, v in no_cluster_env.items() if k != "KUBECONFIG"}
    line = one_line(out := run_cli([command, *CLUSTER[command]], env=env, cwd=REPO))
    assert out.returncode == ExitCode.NO_CLUSTER and "~/.kube/config ($KUBECONFIG unset)" in line


def test_an_explicit_kubeconfig_is_the_only_one_tried(no_cluster_env, tmp_path):
    """--kubeconfig names one cluster: a bad file there must not quietly fall back to another one."""
    line = one_line(out := run_cli(["status", "demo", "--kubeconfig", str(tmp_path / "nope")], env=no_cluster_env))
    assert out.returncode == ExitCode.NO_CLUSTER
    assert line.startswith(f"eagle-jobs: error: --kubeconfig {tmp_path / 'nope'}:") and "in-cluster" not in line


def test_an_unreachable_api_server_is_one_line(no_cluster_env, tmp_path):
    from conftest import free_port

    kc = tmp_path / "kubeconfig"
    kc.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{free_port()}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    line = one_line(out := run_cli(["status", "demo", "--kubeconfig", str(kc)], env=no_cluster_env))
    assert out.returncode == ExitCode.NO_CLUSTER and "cluster API unreachable" in line


def test_every_exit_code_is_in_the_operations_table():
    import re

    doc = (REPO / "docs/OPERATIONS.md").read_text()
    table = doc[doc.index("## Exit codes"):doc.index("## What failures look like")]
    assert {int(c) for c in re.findall(r"^\| (\d+) \|", table, re.M)} == {int(c) for c in ExitCode}
