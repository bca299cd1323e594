"""train.source stream (issue 22): training reads extraction's shards as they commit, through a bounded window.

The plan and the sampler are checked as functions; the stream itself runs for real: capture and extraction
of the tiny Kimi-shaped verifier (transformers backends) beside speculators' training, on moto's S3 server,
killed with SIGKILL mid-stream and resumed by a rerun of the same command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import psutil
import pytest
from proc_helpers import MARK, kill_pod, read_lines, wait_for, wait_gone

from eagle_jobs import stream, vllm_cpu
from eagle_jobs.capture import run_capture
from eagle_jobs.committed import RowRef, read_rows
from eagle_jobs.errors import BadInput
from eagle_jobs.pipeline import run_streamed
from eagle_jobs.recipe_file import load_recipe
from eagle_jobs.store import Stage, Store
from eagle_jobs.stream.feed import stream_groups
from eagle_jobs.train.data import StreamBatchSampler

TESTS = Path(__file__).resolve().parent


def _rows(n: int, val_every: int = 5) -> list[RowRef]:
    return [RowRef(f"{i:08d}-00", "validation" if i % val_every == 0 else "train", 10 + (i * 7) % 23,
                   10 + (i * 7) % 23, "capture-shard", 0, 0) for i in range(n)]


def test_the_stream_is_validation_first_then_each_training_row_once_per_pass_workers_interleaved():
    rows = _rows(40)
    order = stream.StreamPlan(rows, 100, 5_000, num_workers=3, passes=2).order
    # each worker's validation shards come before its training shards, and the pass-0 names are the stored mode's
    for w in range(3):
        mine = [s for s in order if s.worker == w]
        kinds = [s.split for s in mine]
        assert kinds == sorted(kinds, key=lambda k: k == "train")
        assert all(s.name.startswith(f"{w:05d}-of-00003-") for s in mine)
    for p in range(2):
        train = [r for s in order if s.pass_index == p and s.split == "train" for r in s.row_ids]
        assert sorted(train) == sorted(r.row_id for r in rows if r.split == "train")
        assert all(s.name.endswith(f"-pass{p:03d}") == (p > 0) for s in order if s.pass_index == p)
    val = [r for s in order if s.split == "validation" for r in s.row_ids]
    assert sorted(val) == sorted(r.row_id for r in rows if r.split == "validation")  # once: kept, not re-read
    # worker 0's k-th shard, then worker 1's, then worker 2's: the order they commit in at the same pace
    assert [s.worker for s in order[:6]] == [0, 1, 2, 0, 1, 2]
    assert len({s.name for s in order}) == len(order)
    assert stream.num_workers_of(order[0].name) == 3
    # what extraction's own worker plans is the same list
    assert [s for s in order if s.worker == 1] == stream.worker_stream(rows, 100, 5_000, 1, 3, 2)


@pytest.mark.parametrize("replicas", [1, 2])
def test_batches_follow_the_stream_and_every_sample_is_read_once_per_epoch(replicas):
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(5, 60, size=90)]
    groups = [list(range(i, min(i + 12, 90))) for i in range(0, 90, 12)]  # 8 groups in stream order
    group_of = {i: g for g, idx in enumerate(groups) for i in idx}
    samplers = [StreamBatchSampler(lengths, groups, True, 128, replicas, r, seed=3) for r in range(replicas)]
    for epoch in (0, 1):
        per_rank = [s._generate_batches(epoch) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1  # every rank steps together
        seen = [int(i) - epoch * 90 for b in per_rank for batch in b for i in batch]
        assert len(seen) == len(set(seen)) and len(seen) >= 90 - (replicas - 1)  # speculators drops < replicas
        assert all(epoch * 90 <= int(i) < (epoch + 1) * 90 for b in per_rank for batch in b for i in batch)
        # a step never reads behind an earlier step's groups: steps advance through the stream
        step_groups = [[group_of[int(i) - epoch * 90] for b in per_rank for i in b[j]] for j in range(len(per_rank[0]))]
        assert all(max(a) <= min(b) for a, b in zip(step_groups, step_groups[1:]) if a and b)
        # groups_done: nondecreasing, the same on every rank, every group at the epoch's end, and never a group
        # a later step still reads
        done = [[s.groups_done(epoch, j) for j in range(len(per_rank[0]) + 1)] for s in samplers]
        assert all(d == done[0] for d in done) and done[0] == sorted(done[0]) and done[0][-1] == len(groups)
        for j in range(len(per_rank[0])):
            later = [g for k in range(j + 1, len(step_groups)) for g in step_groups[k]]
            assert not later or done[0][j + 1] <= min(later), (epoch, j)
    # another epoch shuffles within the groups, not across them
    e0, e1 = ([sorted(int(i) % 90 for i in b) for b in samplers[0]._generate_batches(e)] for e in (0, 1))
    assert e0 != e1


def test_stream_groups_hold_consecutive_shards_up_to_the_group_size():
    shards = stream.StreamPlan(_rows(60), 100, 3_000, 1, 1).order
    train = [s for s in shards if s.split == "train"]
    groups = stream_groups(train, 7_000)
    assert [s for g in groups for s in g] == train
    assert all(len(g) == 1 or sum(s.planned_bytes for s in g) <= 7_000 for g in groups)


def test_a_restarted_extractor_skips_a_shard_training_consumes_while_it_lists(tmp_path):
    """Training consumes a committed shard (marker, then its data deleted) just as a restarted extractor
    checks whether that shard is committed: the extractor still skips it. Listing the consumed markers
    before the commits, it extracted that shard again (once in a full run, 2026-12-06)."""
    stage = Stage(Store.open(f"file://{tmp_path}/s"), "r", "extract")
    shards = [stream.StreamShard(name, 0, 0, "train", (), 1) for name in ("a", "b", "c")]
    for s in shards[:2]:
        stage.commit_shard(s.name, {s.fname: b"x"}, {})
    real = stage.committed_names

    def consumed_meanwhile() -> set[str]:
        names = real()  # the trainer finishes with "a" just after the extractor's listing
        stream.mark_consumed(stage.store, "r", shards[:1], delete=True, at={})
        return names

    stage.committed_names = consumed_meanwhile
    assert [s.name for s in stream.unfinished(stage, shards)] == ["c"]


@pytest.mark.parametrize(("store", "want"), [
    ({}, "train.source stream needs store.window_bytes"),
    ({"window_bytes": 1000}, "store.window_bytes 1,000 is below 8 x extract.shard_bytes"),
])
def test_a_stream_recipe_without_a_window_that_works_is_refused_in_one_line(tmp_path, store, want):
    p = tmp_path / "r.yaml"
    p.write_text(json.dumps({"name": "x", "verifier": {"model": "m"}, "prompts": {"source": "p"},
                             "aux_layer_ids": [1], "extract": {"shard_bytes": 500},
                             "train": {"source": "stream"}, "store": store}))
    with pytest.raises(BadInput) as e:
        load_recipe(p)
    assert want in str(e.value) and "\n" not in str(e.value)
    p.write_text(json.dumps({"name": "x", "verifier": {"model": "m"}, "prompts": {"source": "p"},
                             "aux_layer_ids": [1], "train": {"later_epochs": "re-extract"}}))
    with pytest.raises(BadInput, match="later_epochs re-extract streams each epoch: it needs train.source: stream"):
        load_recipe(p)


def _stream_recipe(tiny_recipe, tmp_path, uri: str, backend: str = "transformers", **train):
    extract: dict = {"backend": backend, "shard_bytes": 15_000}
    if backend == "vllm":  # the tiny verifier served by real vLLM (vllm-cpu), as tests/test_vllm_real.py serves it
        from conftest import free_port
        from pipeline_helpers import CASES, SERVE

        extract |= {"scratch_dir": str(tmp_path / "scratch"), "concurrency": 8,
                    "vllm": {"serve_args": SERVE + CASES["tiny-kimi"].serve, "health_timeout_s": 600,
                             "port": free_port()}}
    return tiny_recipe(
        prompts={"source": str(_prompts(tmp_path)), "validation": 2},
        # rows of at most 96 tokens: a step reads at most 96 x 521 bytes, an eighth of the window is 50 kB
        limits={"max_prompt_tokens": 80, "max_seq_len": 96},
        extract=extract,
        train={"epochs": 2, "total_seq_len": 64, "source": "stream", "later_epochs": "re-extract", **train},
        store={"uri": uri, "run_id": "r", "window_bytes": 420_000})


def _prompts(tmp_path: Path) -> Path:
    from conftest import write_prompts

    return write_prompts(tmp_path / "stream-prompts.jsonl", n=24)


def _shard_bytes(m: dict) -> int:
    return sum(f["size"] for f in m["files"].values())


def test_training_starts_before_extraction_ends_and_the_store_stays_within_the_window(tiny_recipe, tmp_path, bucket):
    recipe = _stream_recipe(tiny_recipe, tmp_path, f"s3://{bucket}/runs")
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    extract = Stage(st, "r", "extract")
    peak, stop = [0], threading.Event()

    def watch() -> None:  # the store's own bytes, sampled far faster than the pipeline's once a second
        while not stop.wait(0.05):
            peak[0] = max(peak[0], stream.stored_bytes(Store.open(recipe.store.uri), "r"))

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        summary = run_streamed(recipe, st, "r")
    finally:
        stop.set()
        w.join()
    st = Store.open(recipe.store.uri)
    extract = Stage(st, "r", "extract")
    manifests = extract.manifests()
    val = [m for m in manifests if stream.is_validation(m)]
    train = [m for m in manifests if not stream.is_validation(m)]
    # training's first step came before extraction's end: the two ran at the same time
    assert summary["overlap_s"] > 0 and summary["train_first_step_s"] < summary["extract_end_s"], summary
    # the window held: training shards not finished with, plus the kept validation shards and one shard in flight
    corpus = sum(_shard_bytes(m) for m in train)
    bound = recipe.store.window_bytes + sum(_shard_bytes(m) for m in val) + max(_shard_bytes(m) for m in train)
    assert corpus > 2 * recipe.store.window_bytes  # two passes of a corpus far above the window
    assert max(peak[0], summary["peak_store_bytes"]) <= bound, (peak, summary, bound)
    # every training shard of both passes was read, marked and deleted; the validation shards stay
    assert stream.consumed(st, "r") == {m["shard"] for m in train}
    assert {m["shard"] for m in train if m["shard"].endswith("-pass001")} and extract.is_complete()
    assert sorted(k.rsplit("/", 1)[1] for k in st.list(extract.key("data"))) == sorted(
        f"{m['shard']}.safetensors" for m in val)
    final = Stage(st, "r", "train").manifest("final")
    rec = json.loads(Stage(st, "r", "train").read("final/train_config.json", final["files"]["final/train_config.json"]))
    assert rec["stream"]["consumed_shards"] == len(train) and rec["stream"]["later_epochs"] == "re-extract"


def test_keep_mode_stages_each_shard_on_local_disk_so_later_epochs_read_none_from_the_store(tiny_recipe, tmp_path,
                                                                                            bucket, monkeypatch):
    """The node cache: with train.later_epochs keep, the shards a later epoch reads again are staged to
    the work dir as they commit (train.ShardStager), and the second epoch reads them there."""
    from eagle_jobs.train import data
    from eagle_jobs.train.data import staged_name

    monkeypatch.setenv("EAGLE_JOBS_WORK_DIR", str(tmp_path / "work"))
    recipe = _stream_recipe(tiny_recipe, tmp_path, f"s3://{bucket}/runs", later_epochs="keep")
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    reads, from_store = Counter(), Counter()
    staged, ranged = data.read_staged, data.read_sample_bytes

    def spy_staged(store, run_id, root, fname, local_name, e):
        reads[fname, e["row_id"]] += 1
        return staged(store, run_id, root, fname, local_name, e)

    def spy_store(store, run_id, fname, e):
        from_store[fname, e["row_id"]] += 1
        return ranged(store, run_id, fname, e)

    monkeypatch.setattr(data, "read_staged", spy_staged)
    monkeypatch.setattr(data, "read_sample_bytes", spy_store)
    run_streamed(recipe, st, "r")
    manifests = Stage(st, "r", "extract").manifests()
    train = {(f"{m['shard']}.safetensors", e["row_id"]) for m in manifests if not stream.is_validation(m)
             for e in m["samples"] if e["loss_tokens"] > 1}
    assert train and all(reads[k] == 2 for k in train)  # two epochs read every training sample
    assert all(from_store[k] <= 1 for k in train), from_store  # ... and at most the first from the store
    on_disk = {p.name for p in (tmp_path / "work").rglob("*.safetensors")}
    assert {staged_name(f, i) for m in manifests for f, i in m["files"].items()} <= on_disk


def start(recipe_path: Path, tmp_path: Path, name: str, *command: str, mark: str = "") -> subprocess.Popen:
    """`eagle-jobs <command>` in a process of its own, with test_resume's step spy (epoch, step, sample indices);
    `mark`: test_exit_paths' marker in its environment, which every process it starts inherits."""
    env = {**os.environ, "EAGLE_JOBS_WORK_DIR": str(tmp_path / f"work-{name}"),
           "STEP_LOG": str(tmp_path / f"{name}.steps.jsonl"),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           **({MARK: mark} if mark else {})}
    out = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - read while it runs
    return subprocess.Popen([sys.executable, "-c", "import test_resume; test_resume.spied_pod_main()", *command,
                             "--recipe", str(recipe_path)], env=env, stdout=out, stderr=subprocess.STDOUT)


def _captured(tiny_recipe, tmp_path: Path, bucket: str, backend: str = "transformers", epochs: int = 2):
    recipe = _stream_recipe(tiny_recipe, tmp_path, f"s3://{bucket}/runs", backend,
                            checkpoint_every_minutes=0.05 / 60, epochs=epochs)
    run_capture(recipe, Store.open(recipe.store.uri), "r")
    rfile = tmp_path / "recipe.json"
    rfile.write_text(json.dumps(recipe.model_dump(mode="json")))
    return recipe, rfile


def _kill_mid_stream(recipe, tmp_path: Path, proc: subprocess.Popen, name: str,
                     after: set[str] = frozenset(), kill=kill_pod) -> set[str]:
    """SIGKILL `proc` (and, by default, what it started) once training has finished with some shards (4, or 2
    more than `after`) and extraction is not done; the shards consumed then."""
    watch = Store.open(recipe.store.uri)

    def mid_stream() -> bool:
        time.sleep(0.2)  # a listing of moto's bucket at most five times a second
        consumed = stream.consumed(watch, "r")
        return (len(consumed) >= 4 and len(consumed - after) >= 2
                and not Stage(watch, "r", "extract").is_complete())

    wait_for(proc, tmp_path / f"{name}.log", "consumed shards mid-stream", mid_stream, timeout=600)
    kill(proc)
    return stream.consumed(Store.open(recipe.store.uri), "r")


def _nothing_lost_nothing_twice(recipe, tmp_path: Path, consumed_at_kill: set[str], extract_logs: list[str],
                                train_logs: list[str]) -> None:
    """Every training shard of both passes committed, read and deleted once; nothing consumed extracted again;
    each training sample trained once per epoch: the killed trainer's steps up to its newest checkpoint, then
    its successor's (or one trainer's steps, when it was not the one killed)."""
    st = Store.open(recipe.store.uri)
    extract, train = Stage(st, "r", "extract"), Stage(st, "r", "train")
    assert extract.is_complete() and train.is_complete()
    names = {m["shard"] for m in extract.manifests() if not stream.is_validation(m)}
    assert stream.consumed(st, "r") == names and consumed_at_kill < names
    later = "".join((tmp_path / f"{n}.log").read_text() for n in extract_logs[1:])
    assert not any(f"committed {n}:" in later for n in consumed_at_kill), later[-2000:]
    committed = [ln for n in extract_logs for ln in (tmp_path / f"{n}.log").read_text().splitlines()
                 if ln.startswith("  committed 0")]
    # no shard committed twice (a SIGKILL can cut a killed process's last log lines, never add one)
    assert len(committed) == len({ln.split(":")[0] for ln in committed})
    rows = [r for r in read_rows(st, "r") if r["split"] == "train" and sum(r["loss_mask"]) > 1]
    steps = [[e for e in read_lines(tmp_path / f"{n}.steps.jsonl") if "step" in e] for n in train_logs]
    resumed_at = (steps[1][0]["epoch"], steps[1][0]["step"]) if len(steps) > 1 else (recipe.train.epochs, 0)
    if len(steps) > 1:
        assert resumed_at > (0, 1) and any((e["epoch"], e["step"]) < resumed_at for e in steps[0])  # mid-stream
    n = len(rows)
    for epoch in range(recipe.train.epochs):
        seen = [s - epoch * n for e in steps[0] if e["epoch"] == epoch and (e["epoch"], e["step"]) < resumed_at
                for s in e["samples"]]
        seen += [s - epoch * n for later_steps in steps[1:] for e in later_steps if e["epoch"] == epoch
                 for s in e["samples"]]
        assert sorted(seen) == list(range(n)), (epoch, sorted(seen))


class Stranger:
    """What an earlier, killed run leaves on the port: healthy, serving the same model id."""

    def __init__(self, port: int, model_id: str):
        self.requests: list[str] = []
        stranger = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, body: dict | str) -> None:
                stranger.requests.append(f"{self.command} {self.path}")
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("" if self.path == "/health" else {"data": [{"id": model_id}]})

            def do_POST(self):
                self._answer({})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.vllm
@pytest.mark.e2e
@pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")
def test_a_sigkill_mid_stream_resumes_with_no_shard_lost_and_no_sample_trained_twice(tiny_recipe, tmp_path, bucket):
    """Issue 22's done-when, on moto's S3 with the extraction of real vLLM; and a stage's vLLM server lives and
    dies with the stage. `eagle-jobs run` runs both sides in one process: SIGKILL to that process alone takes
    both at once, and its guard takes the server along: nothing carrying the run's marker (the stage, the
    guard, `vllm serve`, vLLM's engine core and any process it spawned or forked) is left on the machine. The rerun
    finds an earlier server healthy on the recipe's port, serving the same model id, and never uses it.
    (The transformers backend's extraction is killed and resumed in
    test_either_side_killed_alone_resumes_while_the_other_goes_on.)"""
    from eagle_jobs.weights import resolve_path

    tree: list[list[str]] = []

    def kill_the_stage_alone(proc: subprocess.Popen) -> None:
        """SIGKILL to the stage's own process only, noting what it had started: that must go by its guard."""
        tree.extend(c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True))
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    recipe, rfile = _captured(tiny_recipe, tmp_path, bucket, "vllm")
    run = ("run", "--stages", "extract,train")
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    consumed = _kill_mid_stream(recipe, tmp_path, start(rfile, tmp_path, "run1", *run, mark=first), "run1",
                                kill=kill_the_stage_alone)
    # what was running: the guard, `vllm serve`, and vLLM's own engine core
    assert any("eagle_jobs.vllm_guard" in c for c in tree) and any("serve" in c for c in tree)
    assert len(tree) >= 4, tree
    assert wait_gone(first, 150) == []  # the guard saw the stage go and stopped everything

    port = recipe.extract.vllm.port
    stranger = Stranger(port, resolve_path(recipe.verifier))  # what `vllm serve` names the model
    try:
        run2 = start(rfile, tmp_path, "run2", *run, mark=second)
        assert run2.wait(timeout=900) == 0, (tmp_path / "run2.log").read_text()[-3000:]
    finally:
        stranger.stop()
    log2 = (tmp_path / "run2.log").read_text()
    assert stranger.requests == [], stranger.requests
    assert f"port {port} is taken" in log2 and "this stage's vLLM server uses port" in log2
    assert wait_gone(second, 150) == []
    assert "streamed into train" in log2  # `eagle-jobs run` ran the two as one step
    assert "vllm-extract-0.log" in log2  # the extraction was real vLLM's, a fresh server for the rerun
    _nothing_lost_nothing_twice(recipe, tmp_path, consumed, ["run1", "run2"], ["run1", "run2"])


def test_either_side_killed_alone_resumes_while_the_other_goes_on(tiny_recipe, tmp_path, bucket):
    """As on Kubernetes, where extraction and training are pods of their own: one is killed, its Job starts it
    again, and the other never stopped. Training is killed first; extraction later, while the second trainer
    reads: one stream, each side killed once."""
    recipe, rfile = _captured(tiny_recipe, tmp_path, bucket)
    procs = {side: start(rfile, tmp_path, f"{side}1", side) for side in ("extract", "train")}
    consumed = _kill_mid_stream(recipe, tmp_path, procs["train"], "train1")
    assert procs["extract"].poll() is None  # extraction goes on
    procs["train"] = start(rfile, tmp_path, "train2", "train")
    consumed = _kill_mid_stream(recipe, tmp_path, procs["extract"], "extract1", after=consumed)
    assert procs["train"].poll() is None  # and so does the second trainer
    procs["extract"] = start(rfile, tmp_path, "extract2", "extract")
    for side, p in procs.items():
        assert p.wait(timeout=900) == 0, (side, (tmp_path / f"{side}2.log").read_text()[-3000:])
    _nothing_lost_nothing_twice(recipe, tmp_path, consumed, ["extract1", "extract2"], ["train1", "train2"])


def test_a_late_extraction_worker_gets_the_shard_training_waits_for_through_a_full_window(tiny_recipe, tmp_path,
                                                                                          bucket):
    """Two extraction workers, as the cluster's Indexed Job runs them; worker 1 starts first and fills the
    window with shards training cannot use before worker 0's first one. Worker 0, started late (its
    server slow to load), still commits the shard training is blocked on: nothing waits for ever."""
    recipe, rfile = _captured(tiny_recipe, tmp_path, bucket, epochs=3)
    w1 = start(rfile, tmp_path, "extract-w1", "extract", "--shard-index", "1", "--num-shards", "2")
    train = start(rfile, tmp_path, "train1", "train")
    wait_for(w1, tmp_path / "extract-w1.log", "a full window",
             lambda: time.sleep(0.2) or "window full" in (tmp_path / "extract-w1.log").read_text(), timeout=600)
    w0 = start(rfile, tmp_path, "extract-w0", "extract", "--shard-index", "0", "--num-shards", "2")
    for name, p in (("extract-w1", w1), ("extract-w0", w0), ("train1", train)):
        assert p.wait(timeout=900) == 0, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
    _nothing_lost_nothing_twice(recipe, tmp_path, set(), ["extract-w0", "extract-w1"], ["train1"])


def test_streaming_over_an_extraction_made_in_stored_mode_is_refused_in_one_line(tiny_recipe, tmp_path):
    """Stored and stream plans name their shards alike but fill them differently: a stream must never read
    a stored extraction's shard as if it held the rows the stream plan puts there."""
    from eagle_jobs.extract import run_extract
    from eagle_jobs.train.run import run_train

    stored = _stream_recipe(tiny_recipe, tmp_path, f"file://{tmp_path}/store").model_dump(mode="json")
    stored["train"] |= {"source": "stored", "later_epochs": "keep"}
    stored = type(_stream_recipe(tiny_recipe, tmp_path, "file:///x")).model_validate(stored)
    st = Store.open(stored.store.uri)
    run_capture(stored, st, "r")
    run_extract(stored, st, "r")
    streamed = _stream_recipe(tiny_recipe, tmp_path, stored.store.uri)
    with pytest.raises(BadInput, match="does not hold row .* extracted in stored mode or with other settings") as e:
        run_train(streamed, st, "r", work_dir=tmp_path / "w")
    assert "\n" not in str(e.value)
