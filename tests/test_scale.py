"""The recipe's scale: a pod's memory follows its shard, not the corpus; reading a run's manifests and waiting
on the other stage beat the heartbeat; and the scale rehearsal (benchmarks/scale) at two row counts."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle_jobs import heartbeat, stream
from eagle_jobs import store as store_mod
from eagle_jobs.committed import encode_rows, load_rows, read_rows, row_index, row_refs
from eagle_jobs.errors import BadInput
from eagle_jobs.store import Stage, Store

REPO = Path(__file__).resolve().parents[1]


def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"row_id": f"{i:08d}-00", "prompt_index": i, "prompt_sha256": "", "turn": 0,
             "split": "validation" if i % 4 == 0 else "train", "input_ids": list(range(5 + i % 7)),
             "loss_mask": [0, 0] + [1] * (3 + i % 7), "num_prompt_tokens": 2, "num_completion_tokens": 3 + i % 7,
             "finish_reason": "stop", "reasoning": None, "content": f"answer {i} ü"} for i in range(start, start + n)]


def _commit(stage: Stage, name: str, rows: list[dict], with_index: bool) -> None:
    blob, index = encode_rows(rows)  # as capture commits a shard
    assert index == row_refs(blob)  # what a reader derives from a shard committed without one
    stage.commit_shard(name, {f"{name}.jsonl": blob}, {"row_index": index} if with_index else {})


@pytest.mark.parametrize("with_index", [True, False])
def test_the_row_index_plans_and_load_rows_reads_exactly_the_rows(store_uri, with_index):
    """From the manifests' row_index (what capture commits), or from the data of a shard committed without
    one: the same ids, splits and counts as the rows, and load_rows gives back exactly the rows asked for."""
    st = Store.open(store_uri)
    stage = Stage(st, "r", "capture")
    _commit(stage, "00000-of-00002-00000", _rows(9), with_index)
    _commit(stage, "00001-of-00002-00000", _rows(8, start=9), with_index)
    stage.complete({})
    rows = read_rows(st, "r")
    refs = row_index(st, "r")
    assert [(r.row_id, r.split, r.num_tokens, r.loss_tokens) for r in refs] == [
        (r["row_id"], r["split"], len(r["input_ids"]), sum(r["loss_mask"])) for r in rows]
    pick = [refs[i] for i in (16, 0, 3, 4, 10, 2)]  # across both shards, out of order, with gaps
    assert load_rows(st, "r", pick) == [rows[i] for i in (16, 0, 3, 4, 10, 2)]
    assert load_rows(st, "r", pick, max_gap=0) == [rows[i] for i in (16, 0, 3, 4, 10, 2)]  # one read per row


def test_a_row_index_that_does_not_match_its_data_is_refused_in_one_line(tmp_path):
    st = Store.open(f"file://{tmp_path}/s")
    stage = Stage(st, "r", "capture")
    blob = "".join(json.dumps(r) + "\n" for r in _rows(3)).encode()
    index = row_refs(blob)
    index[0][0], index[1][0] = index[1][0], index[0][0]  # two rows' ids swapped
    stage.commit_shard("s", {"s.jsonl": blob}, {"row_index": index})
    stage.complete({})
    with pytest.raises(BadInput, match="hold row 00000001-00, its manifest says 00000000-00; rerun capture"):
        load_rows(st, "r", row_index(st, "r")[:1])


def test_reading_many_manifests_is_concurrent_and_beats_the_heartbeat(store_uri, tmp_path, monkeypatch):
    """A worker that reads a run's manifests before its first progress (the reuse indexes, the row index)
    beats between batches: at the recipe's scale that is thousands of objects before the startup probe."""
    st = Store.open(store_uri)
    stage = Stage(st, "r", "extract")
    for i in range(7):
        stage.commit_shard(f"s{i}", {f"s{i}.safetensors": b"x"}, {"i": i})
    hb = tmp_path / "hb"
    monkeypatch.setenv(heartbeat.ENV, str(hb))
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.0)
    monkeypatch.setattr(store_mod, "GET_BATCH", 3)
    batches = []
    real = st.get_many
    monkeypatch.setattr(Store, "get_many", lambda self, keys, on_batch=None: real(
        keys, on_batch=lambda n: (batches.append(n), on_batch and on_batch(n))))
    assert [m["i"] for m in stage.manifests()] == list(range(7))
    assert batches == [3, 6, 7] and hb.exists()
    assert stage.committed_names() == {f"s{i}" for i in range(7)}
    st.delete(stage.key("data/s3.safetensors"))  # a consumed shard's data deleted: not committed any more
    assert "s3" not in stage.committed_names()


def test_an_extractor_waiting_on_a_full_window_beats_and_goes_on_when_training_consumes(tmp_path, monkeypatch):
    """Waiting for training is progress: the worker's liveness probe must not kill an extractor whose
    trainer starts late (it starts only once extraction is Ready, on a free node)."""
    st = Store.open(f"file://{tmp_path}/s")
    stage = Stage(st, "r", "extract")
    stage.commit_shard("a", {"a.safetensors": b"x" * 100}, {"samples": [{"split": "train"}]})
    hb = tmp_path / "hb"
    monkeypatch.setenv(heartbeat.ENV, str(hb))
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.0)
    monkeypatch.setattr(stream.window, "POLL_S", 0.05)
    window = stream.Window(st, "r", 150, [stream.StreamShard(n, 0, 0, "train", (), 100) for n in "ab"])
    done = threading.Event()
    t = threading.Thread(target=lambda: (window.wait("b", 100, say=lambda _m: None), done.set()))
    t.start()
    time.sleep(0.5)
    assert not done.is_set() and hb.exists()  # full: waiting, and beating
    first = hb.stat().st_mtime
    time.sleep(0.3)
    assert hb.stat().st_mtime >= first
    stream.mark_consumed(st, "r", [stream.StreamShard("a", 0, 0, "train", (), 100)], delete=False, at={})
    t.join(10)
    assert done.is_set()


def _rehearse():
    spec = importlib.util.spec_from_file_location("rehearse", REPO / "benchmarks/scale/rehearse.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rehearse"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.e2e
def test_no_pod_memory_grows_with_the_corpus(tmp_path):
    """The scale rehearsal's pods (capture, the four extraction workers, a training rank's data, evaluate's
    sets) at 1,500 and 6,000 conversations of the Kimi recipe, rows at an eighth of their tokens: each pod's
    peak RSS grows by at most 4 KiB per conversation (as Row objects the rows alone grew it by about 17 KiB
    each), every pod beats within its probes, and no pod would be killed. 4 KiB, not less: the training rank
    holds an index entry per sample (about 1 KiB measured alone) and its peak moves by 10 to 15 MB from run
    to run on loaded cores (its slope read 2.5 and 3.2 KiB so), which 4,500 conversations cannot average out."""
    reh = _rehearse()
    small, large = (reh.rehearse(REPO / "jobs/kimi-k2.5.yaml", n, tmp_path / str(n), 1 / 8, 448, 3)
                    for n in (1_500, 6_000))
    for a, b in zip(small["pods"], large["pods"]):
        assert (a["role"], a["worker"]) == (b["role"], b["worker"])
        slope = (b["peak_rss"] - a["peak_rss"]) / (6_000 - 1_500)
        assert slope <= 4096, f"{a['role']} {a['worker']}: {slope:.0f} B more RSS per conversation"
        assert not b["killed_by"], (b["role"], b["killed_by"])
        if b["role"] not in ("status",):
            assert b["first_beat_s"] is not None
    # what the overlay renders follows from this measurement: each pod, extrapolated to the recipe's counts
    # (its limit and 1 M conversations) along the slope just measured, with an extraction worker's shard in
    # flight at the real scale, fits its memory limit with headroom and beats within its startup probe
    from eagle_jobs.recipe_file import load_recipe

    limit_rows = load_recipe(REPO / "jobs/kimi-k2.5.yaml").prompts.limit
    for a, b in zip(small["pods"], large["pods"]):
        if b["memory_limit"] is None:
            continue
        for n in (limit_rows, 1_000_000):
            grow = max(0.0, (b["peak_rss"] - a["peak_rss"]) / 4_500) * (n - 6_000)
            est = b["est_peak"] + grow
            assert est <= reh.HEADROOM * b["memory_limit"], (b["role"], n, est / 2**30, b["memory_limit"] / 2**30)
            if b["startup_window_s"] and b["first_beat_s"] is not None:
                beat_at = b["first_beat_s"] + max(0.0, (b["first_beat_s"] - a["first_beat_s"]) / 4_500) * (n - 6_000)
                assert beat_at <= b["startup_window_s"], (b["role"], n, beat_at)
    train = next(p for p in large["pods"] if p["role"] == "train")
    assert train["result"]["train_samples"] > 0.7 * 6_000 and train["result"]["steps_epoch0"] > 0
    assert all(p["result"]["shards"] > 0 for p in large["pods"] if p["role"] == "extract")
    assert os.path.getsize(tmp_path / "6000" / "work-6000" / "moto.log") > 0


@pytest.mark.parametrize("where", ["local", "store"])
def test_the_prompt_index_holds_refs_and_loads_a_shards_conversations_by_range(store_uri, tmp_path, where):
    """Capture and evaluate keep a PromptRef a conversation and read the messages of the shard they work on:
    the same conversations, splits and order as reading the whole set; a set changed under a run is refused."""
    from eagle_jobs.prompts import read_prompts, scan_prompts
    from eagle_jobs.recipe import PromptSpec

    lines = [json.dumps({"conversations": [{"from": "human", "value": f"question {i} " + "x" * (i % 13)},
                                           {"from": "gpt", "value": "old answer"}]}) for i in range(40)]
    lines.insert(7, "not json")
    body = ("\n".join(lines) + "\n").encode()
    if where == "local":
        source = str(tmp_path / "p.jsonl")
        Path(source).write_bytes(body)
    else:
        Store.open(store_uri).put("prompts/p.jsonl", body)
        source = f"{store_uri}/prompts/p.jsonl"
    spec = PromptSpec(source=source, validation=0.25)
    index, rejects = scan_prompts(spec)
    whole, _ = read_prompts(spec)
    assert rejects.rejected == 1 and len(index.refs) == 40 and index.generations == 40
    assert [(r.position, r.sha, r.split) for r in index.refs] == [(c.index, c.sha, c.split) for c in whole]
    pick = [index.refs[i] for i in (30, 2, 3, 17)]
    assert index.load(pick) == [whole[i] for i in (30, 2, 3, 17)]
    changed = body.replace(b"question 3 ", b"question 3!")
    if where == "local":
        Path(source).write_bytes(changed)
    else:
        Store.open(store_uri).put("prompts/p.jsonl", changed)
    with pytest.raises(BadInput, match="changed while in use"):
        index.load([index.refs[3]])


def test_the_reuse_index_reads_an_earlier_streamed_run_without_a_request_per_shard(tmp_path, monkeypatch):
    """An earlier streamed run leaves a manifest and a consumed marker per shard (50,000 at the Kimi recipe):
    the hidden-state reuse index reads the manifests concurrently and tells deleted shards by listings, never
    a GET and a HEAD per shard before the worker's first heartbeat; states re-extract mode deleted are not reused."""
    from eagle_jobs import reuse

    st = Store.open(f"file://{tmp_path}/s")
    Stage(st, "old", "capture").commit_shard("c", {"c.jsonl": b"{}"}, {})
    ext = Stage(st, "old", "extract")
    shards = [stream.StreamShard(f"00000-of-00001-{k:05d}", 0, 0, "train", (), 1) for k in range(30)]
    for k, s in enumerate(shards):
        ext.commit_shard(s.name, {s.fname: b"x"}, {"settings_digest": "d", "samples": [{"ids_sha256": f"h{k}"}]})
    stream.mark_consumed(st, "old", shards[:10], delete=True, at={})  # re-extract: data gone
    stream.mark_consumed(st, "old", shards[10:20], delete=False, at={})  # keep: data stays
    monkeypatch.setattr(reuse, "extract_digest", lambda _r: "d")
    calls = {"get": 0, "size": 0}
    for name in calls:
        real = getattr(Store, name)
        monkeypatch.setattr(Store, name, lambda self, *a, _real=real, _n=name, **k: (
            calls.__setitem__(_n, calls[_n] + 1), _real(self, *a, **k))[1])
    index = reuse.HiddenStateIndex.build(st, None, "new")
    assert sorted(index.where) == sorted(f"h{k}" for k in range(10, 30))
    assert calls == {"get": 0, "size": 0}, calls


def test_a_nodes_ranks_count_the_target_tokens_once(tmp_path, monkeypatch):
    """Every training rank needs the vocab mapping's token counts; reading every capture row takes minutes at
    the recipe's scale, so the node's first rank counts, in a few shards at a time, and the others read its
    counts from the work dir; a new capture (another completion) is counted again."""
    from eagle_jobs.train import data

    st = Store.open(f"file://{tmp_path}/s")
    stage = Stage(st, "r", "capture")
    for k in range(3):
        _commit(stage, f"00000-of-00001-{k:05d}", _rows(5, start=5 * k), with_index=True)
    stage.complete({})
    reads = []
    real = Store.get_many
    monkeypatch.setattr(Store, "get_many", lambda self, keys, on_batch=None: (reads.append(len(keys)),
                                                                              real(self, keys, on_batch))[1])
    want = data.token_frequencies([], st, "r")
    assert sum(want.values()) == sum(sum(r["loss_mask"]) for r in read_rows(st, "r") if r["split"] == "train")
    reads.clear()
    cache = tmp_path / "work" / "token-frequencies"
    assert data.token_frequencies([], st, "r", cache) == want and reads  # the first rank counts
    reads.clear()
    assert data.token_frequencies([], st, "r", cache) == want and not reads  # the others read its counts
    stage.complete({"again": True})  # a capture completed anew: counted anew
    assert data.token_frequencies([], st, "r", cache) == want and reads


def test_a_window_wait_ends_when_training_stops_marking_itself_alive(tmp_path, monkeypatch):
    """Every wait still ends when the other side is gone: an extractor on a full window waits for a trainer
    that has not started (no mark yet) or marks itself alive, and fails (exit 5, retried) once the mark goes
    stale, instead of beating its heartbeat for ever."""
    from eagle_jobs.errors import Unavailable

    st = Store.open(f"file://{tmp_path}/s")
    stage = Stage(st, "r", "extract")
    stage.commit_shard("a", {"a.safetensors": b"x" * 100}, {"samples": [{"split": "train"}]})
    monkeypatch.setattr(stream.window, "POLL_S", 0.01)
    monkeypatch.setattr(stream.window, "REPORT_S", 0.0)
    window = stream.Window(st, "r", 150, [stream.StreamShard(n, 0, 0, "train", (), 100) for n in "ab"])
    stream.check_training_alive(st, "r", window.started)  # no trainer yet: waited for
    st.put_json(stream.alive_key("r"), {"at": time.time() - 3600, "started_at": window.started - 7200})
    stream.check_training_alive(st, "r", window.started)  # an earlier attempt's trainer: its successor waited for
    monkeypatch.setattr(stream.window, "ALIVE_EVERY_S", 0.05)
    alive = stream.TrainingAlive(st, "r").start()
    time.sleep(0.2)
    stream.check_training_alive(st, "r", window.started, stale_s=1.0)  # alive: waited for
    alive.stop()
    alive.thread.join(5)
    # this attempt's trainer, its last mark an hour ago
    st.put_json(stream.alive_key("r"), {"at": time.time() - 3600, "started_at": alive.started_at})
    with pytest.raises(Unavailable, match="training of run 'r' last marked itself alive 3600 s ago"):
        window.wait("b", 100, say=lambda _m: None)
