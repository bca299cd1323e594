"""Every way a local run can end (docs/OPERATIONS.md#how-a-local-run-ends): its exit code, what is left
in the store and on disk, and what a rerun does. One test per row of that table.

Each run is `eagle-jobs capture` in its own process, as a user runs it, on the tiny Kimi-shaped
verifier. The rows about a server (unavailable, SIGTERM, SIGKILL) use stand-ins for `vllm` that the
stage starts itself, as it starts real vLLM (tests/test_stream.py SIGKILLs a stage serving real vLLM):
tests/fake_vllm.py's server slowed to one answer a second, and a `vllm` that fails at start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO
from proc_helpers import EAGLE_JOBS, MARK, marked, one_line, run_cli, wait_gone

from eagle_jobs.errors import ExitCode
from eagle_jobs.store import Stage, Store

pytestmark = pytest.mark.e2e

SHARDS = 3  # tiny_recipe: 12 conversations, 4 a shard
ROW_IDS = [f"{i:08d}-{t:02d}" for i in range(12) for t in range(2 if i % 4 == 0 else 1)]  # every 4th: 2 turns


STAND_INS = {
    # fake_vllm's `vllm serve` with one answer a second: a run lasts long enough to be stopped mid-way
    "slow": """
import sys, time
sys.path.insert(0, {tests!r})
import fake_vllm
class Slow(fake_vllm.FakeVllm):
    def chat(self, body):
        time.sleep(1.0)
        return super().chat(body)
fake_vllm.FakeVllm = Slow
fake_vllm.main()
""",
    # a server that dies while loading, after 40 lines of its own log
    "broken": """
import sys
for i in range(1, 41):
    print(f"engine line {{i}}", file=sys.stderr)
sys.exit(1)
""",
}


@pytest.fixture
def run(tmp_path, tiny_recipe):
    """run(kind, *args, env=..., **recipe overrides): `eagle-jobs capture` on the tiny verifier."""

    def make(server: str | None = None, **over) -> Path:
        if server:
            bindir = tmp_path / f"bin-{server}"
            bindir.mkdir(exist_ok=True)
            script = bindir / "vllm"
            script.write_text(f"#!{sys.executable}\n" + STAND_INS[server].format(tests=str(REPO / "tests")))
            script.chmod(0o755)
            from conftest import free_port

            over.setdefault("capture", {"backend": "vllm", "concurrency": 1, "vllm": {
                "port": free_port(), "health_timeout_s": 120, "serve_args": ["--reasoning-parser", "kimi_k2"]}})
        recipe = tiny_recipe(**over)
        path = tmp_path / f"recipe-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(recipe.model_dump(mode="json")))
        return path

    def env(server: str | None = None, mark: str = "") -> dict[str, str]:
        path = f"{tmp_path / f'bin-{server}'}{os.pathsep}{os.environ['PATH']}" if server else os.environ["PATH"]
        return {**os.environ, "PATH": path, MARK: mark, "EAGLE_JOBS_WORK_DIR": str(tmp_path / "work")}

    return make, env


def committed(st: Store, run_id: str = "t") -> list[dict]:
    stage = Stage(st, run_id, "capture")
    manifests = stage.manifests()
    assert all(stage.is_committed(m["shard"]) for m in manifests)  # every manifest's objects whole
    return manifests


def rows_exactly_once(st: Store) -> None:
    from eagle_jobs.committed import read_rows

    assert [r["row_id"] for r in read_rows(st, "t")] == ROW_IDS  # none lost, none twice
    shards = [m["shard"] for m in committed(st)]
    assert len(shards) == len(set(shards)) == SHARDS


def store_of(tmp_path: Path) -> Store:
    return Store.open(f"file://{tmp_path}/store")


def test_success_and_a_rerun_that_skips_everything(run, tmp_path):
    make, env = run
    recipe = make()
    out = run_cli(["capture", "--recipe", str(recipe)], env=env())
    assert out.returncode == ExitCode.OK, out.stderr[-2000:]
    st = store_of(tmp_path)
    rows_exactly_once(st)
    before = {m["shard"]: m["committed_at"] for m in committed(st)}
    again = run_cli(["capture", "--recipe", str(recipe)], env=env())
    assert again.returncode == ExitCode.OK and f"{SHARDS} already committed" in again.stderr
    assert {m["shard"]: m["committed_at"] for m in committed(st)} == before  # nothing rewritten


def test_a_usage_error_writes_nothing(run, tmp_path):
    make, env = run
    out = run_cli(["capture", "--recipe", str(make()), "--shards", "2"], env=env())
    assert out.returncode == ExitCode.USAGE and "No such option: --shards" in one_line(out)
    assert not (tmp_path / "store").exists() and not (tmp_path / "work").exists()


def test_bad_input_is_one_line_and_commits_nothing(run, tmp_path):
    make, env = run
    out = run_cli(["capture", "--recipe", str(make(prompts={"source": str(tmp_path / "missing.jsonl")}))], env=env())
    assert out.returncode == ExitCode.BAD_INPUT and "missing.jsonl" in one_line(out)
    assert committed(store_of(tmp_path)) == []
    assert run_cli(["capture", "--recipe", str(make())], env=env()).returncode == ExitCode.OK  # fixed: it runs
    rows_exactly_once(store_of(tmp_path))


def test_a_store_that_cannot_be_used_is_exit_4_and_nothing_is_written(run, moto_server):
    import boto3

    make, env = run
    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    recipe = make(store={"uri": f"s3://{bucket}/runs", "run_id": "t"})
    out = run_cli(["capture", "--recipe", str(recipe)], env=env())
    assert out.returncode == ExitCode.STORE and f"bucket '{bucket}' does not exist" in one_line(out)
    s3 = boto3.client("s3")
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    s3.create_bucket(Bucket=bucket)
    assert run_cli(["capture", "--recipe", str(recipe)], env=env()).returncode == ExitCode.OK
    rows_exactly_once(Store.open(f"s3://{bucket}/runs"))


def test_a_server_that_fails_is_exit_5_with_the_last_lines_of_its_log(run, tmp_path):
    make, env = run
    mark = uuid.uuid4().hex
    out = run_cli(["capture", "--recipe", str(make("broken"))], env=env("broken", mark))
    assert out.returncode == ExitCode.UNAVAILABLE and "Traceback" not in out.stderr
    log = tmp_path / "work" / "t" / "logs" / "vllm-capture-0.log"
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("eagle-jobs: error: vllm serve exited with code 1 before")
    assert f"vLLM server log: {log}" in out.stderr and "engine line 1" in log.read_text()
    tail = [ln for ln in lines if ln.startswith("  | ")]
    assert len(tail) == 30 and "  | engine line 40" in tail and "  | engine line 10" not in tail
    assert committed(store_of(tmp_path)) == [] and wait_gone(mark, 30) == []
    assert run_cli(["capture", "--recipe", str(make("slow"))], env=env("slow")).returncode == ExitCode.OK
    rows_exactly_once(store_of(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_signal_mid_run_keeps_what_was_committed_stops_the_server_and_the_rerun_finishes(sig, run, tmp_path):
    make, env = run
    recipe, mark = make("slow"), uuid.uuid4().hex
    st = store_of(tmp_path)
    with open(tmp_path / "first.out", "w") as out:
        # preexec: ^C as a terminal delivers it. A command started in the background of a non-interactive
        # shell (a CI runner's or `nohup ... &`) inherits SIGINT ignored (bash(1), "COMMAND EXECUTION
        # ENVIRONMENT"), and Python then installs no KeyboardInterrupt handler: the run would finish, exit 0
        proc = subprocess.Popen([EAGLE_JOBS, "capture", "--recipe", str(recipe)], env=env("slow", mark),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        # the guard first (it lives as long as the server), then signal at the first committed shard
        while not any("eagle_jobs.vllm_guard" in " ".join(p.cmdline()) for p in marked(mark)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.out").read_text()
            time.sleep(0.2)
        while not Stage(st, "t", "capture").manifests():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.out").read_text()
            time.sleep(0.2)
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    text = (tmp_path / "first.out").read_text()
    # SIGTERM and SIGKILL end the process at once (shells report 128 + the signal); ^C ends it in one line
    assert rc == {signal.SIGINT: 130}.get(sig, -sig), text[-2000:]
    if sig == signal.SIGINT:
        assert text.strip().splitlines()[-1] == "eagle-jobs: interrupted" and "Traceback" not in text
    assert 1 <= len(committed(st)) < SHARDS  # stopped mid-run, the committed shards kept whole
    assert wait_gone(mark, 90) == []  # the guard, the server and everything it started are gone
    again = run_cli(["capture", "--recipe", str(recipe)], env=env("slow"))
    assert again.returncode == ExitCode.OK and re.search(r"[12] already committed", again.stderr), again.stderr[-2000:]
    rows_exactly_once(st)


FULL_DISK = """
import errno, os, sys
real_fsync = os.fsync

def fsync(fd):
    # the second shard's data object: written, not yet renamed into place, when its disk fills up
    if "/capture/data/00000-of-00001-00001.jsonl.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_fsync(fd)

os.fsync = fsync
from eagle_jobs.cli import main
sys.argv = ["eagle-jobs", "capture", "--recipe", sys.argv[1]]
main()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_out_of_disk_is_exit_10_and_nothing_half_written_is_committed(run, tmp_path):
    make, env = run
    recipe = make()
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(recipe)], capture_output=True, text=True,
                         env=env(), timeout=600)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]  # the stage's progress, then one line
    line = out.stderr.strip().splitlines()[-1]
    assert out.returncode == ExitCode.NO_SPACE and line.startswith("eagle-jobs: error: no space left on a disk")
    st = store_of(tmp_path)
    assert [m["shard"] for m in committed(st)] == ["00000-of-00001-00000"]  # the shard before the full disk
    data = Stage(st, "t", "capture").key("data")
    assert st.list(data) == [f"{data}/00000-of-00001-00000.jsonl"]  # readers see no part of shard 1
    # on disk: not even the half-written temporary file (the store deletes it when the write fails)
    assert list((tmp_path / "store").rglob("*.tmp-*")) == []
    again = run_cli(["capture", "--recipe", str(recipe)], env=env())
    assert again.returncode == ExitCode.OK and "1 already committed" in again.stderr
    rows_exactly_once(st)


def test_the_operations_table_has_one_tested_row_per_way_a_run_ends():
    doc = (REPO / "docs/OPERATIONS.md").read_text()
    section = doc[doc.index("## How a local run ends"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for ln in section.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if ln.startswith("| **"):
            rows[cells[0].strip("*")] = cells[1]
    assert rows == {
        "success": "0", "usage error": "2", "bad input": "3", "store unusable": "4", "server unavailable": "5",
        "out of disk": "10", "Ctrl-C (SIGINT)": "130", "SIGTERM": "143 (-15)", "SIGKILL": "137 (-9)",
    }
