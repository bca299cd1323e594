"""A new user's first mistakes end in one line and a documented exit code, never a traceback.

Each case runs the installed `eagle-jobs` console script in its own process, as a user would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer
from conftest import REPO
from proc_helpers import one_line, run_cli

from eagle_jobs.cli import app
from eagle_jobs.errors import ExitCode

COMMANDS = sorted(typer.main.get_command(app).commands)
CLUSTER = {  # every command that talks to a cluster, with arguments that get it that far
    "submit": ["--overlay", str(REPO / "k8s/overlays/dev"), "--run-id", "demo"],
    "status": ["--run-id", "demo"],
    "watch": ["--run-id", "demo", "--timeout", "1"],
    "logs": ["--run-id", "demo"],
}


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
    (["status"], "Missing option '--run-id'"),  # no run named, no $EAGLE_JOBS_RUN_ID
    (["capture"], "Missing option '--recipe'"),  # a missing required option
    (["capture", "--recipe", "jobs/demo.yaml", "--shard-index", "two"], "Invalid value for '--shard-index'"),
    (["status", "--run-idd", "demo"], "No such option: --run-idd"),
    (["captur"], "No such command 'captur'"),
])
def test_usage_errors_are_one_line_and_exit_2(args, what):
    out = run_cli(args, env={k: v for k, v in os.environ.items() if k != "EAGLE_JOBS_RUN_ID"})
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
    args = ["status", "--run-id", "demo", "--kubeconfig", str(tmp_path / "nope")]
    line = one_line(out := run_cli(args, env=no_cluster_env))
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
    line = one_line(out := run_cli(["status", "--run-id", "demo", "--kubeconfig", str(kc)], env=no_cluster_env))
    assert out.returncode == ExitCode.NO_CLUSTER and "cluster API unreachable" in line


def test_every_exit_code_is_in_the_operations_table():
    import re

    doc = (REPO / "docs/OPERATIONS.md").read_text()
    table = doc[doc.index("## Exit codes"):]
    table = table[:table.index("\n## ", 1)]
    assert {int(c) for c in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)} == {int(c) for c in ExitCode}


# -- run ids that cannot escape the store (eagle_jobs/runid.py) --------------------------------------
GOOD_IDS = ["demo", "kimi-k2.5", "kimi-k2.5-smoke", "ci-123", "A_b.c", "r" * 33, "7"]
BAD_IDS = {"": "is empty", "../x": "path separator", "../../../x": "path separator", "a/b": "path separator",
           "a\\b": "path separator", "..": "'..'", "a..b": "'..'", ".": "letters, digits", ".hidden": "letters, digits",
           "x.": "letters, digits", "-x": "letters, digits", "a b": "letters, digits", "a\nb": "letters, digits",
           "é": "letters, digits", "r" * 34: "too long", "models": "store's own prefixes",
           "drafts": "store's own prefixes", "prompts": "store's own prefixes"}


@pytest.mark.parametrize("value", GOOD_IDS)
def test_a_short_name_is_a_run_id_and_names_a_jobset_the_webhook_admits(value):
    """JobSet's webhook (kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go, ValidateCreate, v0.12.0)
    requires the longest pod name, <jobset>-<replicatedJob>-<jobIdx>-<podIdx>-<5 random>, to be an
    RFC-1035 label (IsDNS1035Label: at most 63 characters); tests/test_k8s.py checks the rendered names."""
    import re

    from eagle_jobs import cluster
    from eagle_jobs.runid import MAX_LENGTH, check_run_id, run_id_problem

    assert run_id_problem(value) is None and check_run_id(value, "test") == value
    assert MAX_LENGTH == cluster.MAX_JOBSET_NAME - len("eagle-jobs-")
    name = cluster.jobset_name(value)
    for label in (name, f"{name}-evaluate-0-0-abcde"):
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", label) and len(label) <= 63, label


@pytest.mark.parametrize("value", sorted(BAD_IDS))
def test_a_bad_run_id_is_refused_in_one_line_by_the_validator_the_recipe_and_jobset_name(value, tmp_path):
    from eagle_jobs import cluster
    from eagle_jobs.errors import BadInput
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.runid import check_run_id, run_id_problem

    assert BAD_IDS[value] in run_id_problem(value)
    with pytest.raises(BadInput) as e:
        check_run_id(value, "--run-id")
    assert e.value.code == ExitCode.BAD_INPUT and "\n" not in str(e.value) and "(--run-id)" in str(e.value)
    with pytest.raises(BadInput):
        cluster.jobset_name(value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_recipe(tmp_path, value))
    with pytest.raises(BadInput, match="key 'store.run_id'") as e:
        load_recipe(recipe)
    assert "\n" not in str(e.value)


def yaml_recipe(tmp_path: Path, run_id: str | None = None, store: str | None = None) -> str:
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    store_section = {**({"uri": store} if store else {}), **({"run_id": run_id} if run_id is not None else {})}
    return json.dumps({"name": "x", "verifier": {"model": "m"}, "prompts": {"source": str(prompts)},
                       "aux_layer_ids": [1], "store": store_section})


RUN_ID_OPTION = ["capture", "extract", "train", "evaluate", "run", "plan", "compare", "serve-vllm"]
RUN_ID_ARGUMENT = ["status", "watch", "logs", "promote"]


def _store_is_untouched(store_uri: str, tmp_path: Path) -> None:
    """Nothing under the store's root (a file:// root is not even created) and nothing beside it."""
    from eagle_jobs.store import Store

    if store_uri.startswith("file://"):
        assert not (tmp_path / "store").exists() and not (tmp_path / "x").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "r.yaml"]
    else:
        import boto3

        bucket = store_uri.removeprefix("s3://").split("/")[0]
        assert boto3.client("s3").list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
        assert Store.open(store_uri)  # the bucket is there: only the run id stopped the command


@pytest.mark.parametrize("how", ["--run-id", "EAGLE_JOBS_RUN_ID", "store.run_id"])
def test_a_bad_run_id_exits_3_before_anything_is_written(how, store_uri, tmp_path):
    """The three ways a run id comes in, on file:// and on S3 (moto): nothing written under the store's
    root or prefix, nor beside it where ../ would lead."""
    bad = "../x"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_recipe(tmp_path, bad if how == "store.run_id" else None, store_uri))
    env = {**os.environ, **({"EAGLE_JOBS_RUN_ID": bad} if how == "EAGLE_JOBS_RUN_ID" else {})}
    for command in ("capture", "run"):
        args = [command, "--recipe", str(recipe), *(["--run-id", bad] if how == "--run-id" else [])]
        out = run_cli(args, env=env, cwd=tmp_path)
        line = one_line(out)
        assert out.returncode == ExitCode.BAD_INPUT and "'../x'" in line and "path separator" in line
        assert {"--run-id": "(--run-id)", "EAGLE_JOBS_RUN_ID": "($EAGLE_JOBS_RUN_ID)",
                "store.run_id": "key 'store.run_id'"}[how] in line
    _store_is_untouched(store_uri, tmp_path)


@pytest.mark.parametrize("command", RUN_ID_OPTION + RUN_ID_ARGUMENT + ["submit"])
def test_every_command_refuses_a_bad_run_id_in_one_line(command, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_recipe(tmp_path, store=f"file://{tmp_path}/store"))
    if command in RUN_ID_ARGUMENT:
        args = [command, "a/../../b", *(["--to", f"file://{tmp_path}/drafts"] if command == "promote" else [])]
    elif command == "submit":
        args = [command, "--overlay", str(REPO / "k8s/overlays/dev"), "--run-id", "a/../../b"]
    else:
        args = [command, "--recipe", str(recipe), "--run-id", "a/../../b",
                *(["--stage", "capture"] if command == "serve-vllm" else [])]
    out = run_cli(args, cwd=tmp_path)
    assert out.returncode == ExitCode.BAD_INPUT and "run id 'a/../../b'" in one_line(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "r.yaml"]


def test_every_command_names_its_run_with_run_id_and_the_old_argument_still_works(no_cluster_env, tmp_path):
    """One way to name a run in every command (--run-id); status, watch, logs and promote still take the
    run id as an argument, with a one-line notice, and refuse two different ones."""
    for command in COMMANDS:
        params = {p.name for p in typer.main.get_command(app).commands[command].params}
        takes_a_run = params & {"run_id", "run"} or command in ("status", "watch", "logs", "promote")
        assert not takes_a_run or "run_id" in params, command
    out = run_cli(["status", "demo", "--kubeconfig", str(tmp_path / "nope")], env=no_cluster_env)
    notice, error = out.stderr.strip().splitlines()
    assert notice == "eagle-jobs status: the run id as an argument is the old way: use --run-id demo"
    assert error.startswith("eagle-jobs: error: --kubeconfig") and out.returncode == ExitCode.NO_CLUSTER
    line = one_line(out := run_cli(["watch", "a", "--run-id", "b"], env=no_cluster_env))
    assert out.returncode == ExitCode.BAD_INPUT and "run id 'a' as an argument and 'b' as --run-id" in line


def test_version_examples_and_exit_codes_in_the_help():
    out = run_cli(["--version"])
    assert out.returncode == 0 and out.stdout.strip().startswith("eagle-jobs 0.")
    top = run_cli(["--help"]).stdout
    for hidden in ("serve-vllm", "exec-vllm", "guard"):  # pod-internal: run by the manifests, not by people
        assert f"│ {hidden} " not in top
    for command in ("capture", "extract", "train", "evaluate", "run", "compare", "promote", "status", "watch"):
        text = " ".join(run_cli([command, "--help"], env={**os.environ, "COLUMNS": "200"}).stdout.split())
        assert "Example: eagle-jobs " + command in text and "Exit codes: 0 done" in text, command
