import json
import os

import pytest

from eagle_jobs import capture as capture_mod
from eagle_jobs.capture import parse_reasoning, run_capture
from eagle_jobs.committed import read_rows
from eagle_jobs.errors import BadInput, Unavailable
from eagle_jobs.prompts import load_prompts
from eagle_jobs.recipe import PromptSpec
from eagle_jobs.store import Stage, Store
from eagle_jobs.verifier import load_tokenizer


def _check_rows(recipe, rows):
    tok = load_tokenizer(recipe.verifier)
    convs = {c.index: c for c in load_prompts(recipe.prompts)}
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        assert len(ids) == len(mask)
        n = r["num_prompt_tokens"]
        assert mask[:n] == [0] * n and all(m == 1 for m in mask[n:]) and sum(mask) > 0
        if r["turn"] == 0:
            # the exact ids: chat-templated prompt (thinking on) + the generated answer
            msgs = [m for m in convs[r["prompt_index"]].messages if m["role"] != "assistant"][:1]
            enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, thinking=True,
                                          enable_thinking=True)
            assert ids[:n] == list(enc["input_ids"])
            assert tok.decode(ids).startswith(tok.decode(enc["input_ids"]))
            assert tok.decode(ids[:n]).endswith("<|im_assistant|><think>")


def test_capture_rows_on_both_stores(tiny_recipe, store_uri):
    recipe = tiny_recipe()
    st = Store.open(store_uri)
    st.check()
    summary = run_capture(recipe, st, "r1")
    rows = read_rows(st, "r1")
    assert summary["rows_written"] == len(rows) > 12  # 12 conversations, 3 of them two-turn
    assert sorted({r["prompt_index"] for r in rows}) == list(range(12))
    assert {r["turn"] for r in rows if r["prompt_index"] == 0} == {0, 1}
    assert sum(r["split"] == "validation" for r in rows if r["turn"] == 0) == 2
    _check_rows(recipe, rows)
    # second turn's prompt contains the first turn's regenerated answer, not the dataset's
    tok = load_tokenizer(recipe.verifier)
    t1 = next(r for r in rows if r["prompt_index"] == 0 and r["turn"] == 1)
    assert "old answer" not in tok.decode(t1["input_ids"])


def test_deterministic_sharding_and_resume(tiny_recipe, tmp_path, monkeypatch):
    recipe = tiny_recipe()
    st = Store.open(f"file://{tmp_path}/s")
    # worker 1 of 2 runs first, then gets killed half-way through worker 0
    run_capture(recipe, st, "r", shard_index=1, num_shards=2)
    stage = Stage(st, "r", "capture")
    assert not stage.is_complete()
    real = capture_mod.TransformersBackend.run
    calls = {"n": 0}

    def dying(self, convs, stats, advance):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # SIGKILL stand-in: nothing after this point runs
        return real(self, convs, stats, advance)

    monkeypatch.setattr(capture_mod.TransformersBackend, "run", dying)
    with pytest.raises(KeyboardInterrupt):
        run_capture(recipe, st, "r", shard_index=0, num_shards=2)
    assert len(stage.manifests()) == 3 and not stage.is_complete()  # 2 of worker 1, 1 of worker 0
    monkeypatch.setattr(capture_mod.TransformersBackend, "run", real)
    run_capture(recipe, st, "r", shard_index=0, num_shards=2)
    assert stage.is_complete()
    rows = read_rows(st, "r")
    ids = [r["row_id"] for r in rows]
    assert len(ids) == len(set(ids)) and {r["prompt_index"] for r in rows} == set(range(12))
    # the same rows as a single worker produces
    st2 = Store.open(f"file://{tmp_path}/s2")
    run_capture(recipe, st2, "r", shard_index=0, num_shards=1)
    assert [r["input_ids"] for r in read_rows(st2, "r")] == [r["input_ids"] for r in rows]


def test_job_completion_index_is_the_default(tiny_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    monkeypatch.setenv("EAGLE_JOBS_NUM_SHARDS", "3")
    st = Store.open(f"file://{tmp_path}/s")
    s = run_capture(tiny_recipe(), st, "r")
    assert (s["worker"], s["num_workers"]) == (2, 3)
    rows = [json.loads(ln) for _m, _f, d in Stage(st, "r", "capture").iter_objects() for ln in d.decode().splitlines()]
    assert {r["prompt_index"] for r in rows} == {2, 5, 8, 11}


def test_too_long_prompts_are_skipped_and_counted(tiny_recipe, tmp_path):
    recipe = tiny_recipe(limits={"max_prompt_tokens": 14, "max_seq_len": 64})
    st = Store.open(f"file://{tmp_path}/s")
    s = run_capture(recipe, st, "r")
    assert s["skipped_too_long"] > 0
    assert all(r["num_prompt_tokens"] <= 14 for r in read_rows(st, "r"))


def test_vllm_backend_against_openai_server_with_drops(tiny_recipe, tiny_kimi, tmp_path):
    from fake_vllm import FakeVllm

    fake = FakeVllm(str(tiny_kimi), reasoning_parser="kimi_k2", drop_first=3)
    base = fake.start()
    try:
        recipe = tiny_recipe(capture={"backend": "vllm", "concurrency": 4,
                                      "vllm": {"endpoint": base, "max_retries": 5, "health_timeout_s": 10}})
        st = Store.open(f"file://{tmp_path}/s")
        run_capture(recipe, st, "v")
        rows = read_rows(st, "v")
    finally:
        fake.stop()
    assert fake.drop_remaining == 0  # connections were dropped and retried
    _check_rows(recipe, rows)
    # the two backends write one row format, token for token
    st2 = Store.open(f"file://{tmp_path}/s2")
    run_capture(tiny_recipe(), st2, "t")
    ref = read_rows(st2, "t")
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in ref]
    assert set(rows[0]) == set(ref[0])


def test_prompt_over_the_servers_context_is_skipped_not_fatal(tiny_recipe, tiny_kimi, tmp_path):
    """vLLM answers a prompt at or over --max-model-len with HTTP 400, on every rerun: such a turn is
    skipped and counted before it is sent, as limits.max_prompt_tokens are."""
    from fake_vllm import FakeVllm

    fake = FakeVllm(str(tiny_kimi), reasoning_parser="kimi_k2", max_model_len=25)
    base = fake.start()
    try:
        recipe = tiny_recipe(capture={"backend": "vllm", "concurrency": 4, "vllm": {"endpoint": base}})
        st = Store.open(f"file://{tmp_path}/s")
        s = run_capture(recipe, st, "v")
        rows = read_rows(st, "v")
    finally:
        fake.stop()
    assert s["skipped_too_long"] > 0 and rows  # second turns are 25 tokens or more, first ones are not
    assert all(r["num_prompt_tokens"] < 25 for r in rows)


def test_server_dying_mid_run_exits_5_keeps_committed_shards_and_a_rerun_finishes(tiny_recipe, tiny_kimi, tmp_path):
    from fake_vllm import FakeVllm

    from eagle_jobs.store import Stage

    class Dying(FakeVllm):
        """Answers 6 generations, then drops every connection, as a server whose engine died."""

        def chat(self, body):
            self.answered = getattr(self, "answered", 0) + 1
            if self.answered == 6:
                self.drop_remaining = 10**9
            return super().chat(body)

    st = Store.open(f"file://{tmp_path}/s")
    dying = Dying(str(tiny_kimi), reasoning_parser="kimi_k2")
    recipe = tiny_recipe(capture={"backend": "vllm", "concurrency": 1,
                                  "vllm": {"endpoint": dying.start(), "max_retries": 1}})
    try:
        with pytest.raises(Unavailable, match="still failing after 1 retries") as e:
            run_capture(recipe, st, "v")
    finally:
        dying.stop()
    assert e.value.code == 5 and "\n" not in str(e.value)
    committed = [m["rows"] for m in Stage(st, "v", "capture").manifests()]
    assert committed == [5]  # the first shard (4 conversations, one of them two turns) is kept
    healthy = FakeVllm(str(tiny_kimi), reasoning_parser="kimi_k2")
    recipe = tiny_recipe(capture={"backend": "vllm", "vllm": {"endpoint": healthy.start()}})
    try:
        run_capture(recipe, st, "v")
    finally:
        healthy.stop()
    assert healthy.requests == 2 * (len(read_rows(st, "v")) - 5)  # /tokenize + chat, first shard not redone
    assert len(Stage(st, "v", "capture").manifests()) == 3


def test_server_never_healthy(tiny_recipe, tmp_path):
    from conftest import free_port

    recipe = tiny_recipe(capture={"backend": "vllm", "vllm": {"endpoint": f"http://127.0.0.1:{free_port()}",
                                                             "health_timeout_s": 1.5}})
    with pytest.raises(Unavailable, match="not healthy"):
        run_capture(recipe, Store.open(f"file://{tmp_path}/s"), "x")


def test_parse_reasoning():
    assert parse_reasoning("<think>a b</think> c", "kimi_k2") == ("a b", "c")
    assert parse_reasoning("plan</think>answer", "kimi_k2") == ("plan", "answer")
    assert parse_reasoning("<think>unfinished", "kimi_k2") == ("unfinished", "")
    assert parse_reasoning("plain", None) == (None, "plain")
    assert parse_reasoning("plain", "kimi_k2", thinking=False) == (None, "plain")


@pytest.mark.parametrize("text,msg", [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n\n', "line 2: empty line"),
    ("not json\n", "line 1: not JSON"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "no user turn"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}\n', "unknown role 'wizard'"),
    ('{"prompt": "x"}\n', "'messages'"),
])
def test_bad_prompt_files(tmp_path, text, msg):
    p = tmp_path / "p.jsonl"
    p.write_text(text)
    with pytest.raises(BadInput, match=msg):
        load_prompts(PromptSpec(source=str(p)))


def test_prompts_from_store_and_parquet(tmp_path, bucket):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "p.parquet")
    st = Store.open(f"s3://{bucket}/prompts")
    st.put("p.parquet", (tmp_path / "p.parquet").read_bytes())
    convs = load_prompts(PromptSpec(source=f"s3://{bucket}/prompts/p.parquet", validation=0))
    assert [c.messages[0]["content"] for c in convs] == [f"q{i}" for i in range(5)]
    assert all(c.split == "train" for c in convs)


def test_vllm_backend_starts_and_stops_its_own_server(tiny_recipe, tmp_path, monkeypatch, capfd):
    """Inside a Job the worker runs `vllm serve` itself, waits for /health, logs it to a file, stops it."""
    import sys
    from pathlib import Path

    import httpx
    from conftest import free_port

    bindir = Path(__file__).parent / "bin"
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("EAGLE_JOBS_TEST_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    monkeypatch.setenv("EAGLE_JOBS_WORK_DIR", str(tmp_path / "work"))
    port = free_port()
    recipe = tiny_recipe(capture={"backend": "vllm", "vllm": {"port": port, "health_timeout_s": 120,
                                                              "serve_args": ["--reasoning-parser", "kimi_k2"]}})
    st = Store.open(f"file://{tmp_path}/s")
    run_capture(recipe, st, "sp")
    assert len(read_rows(st, "sp")) > 12
    log = tmp_path / "work" / "sp" / "logs" / "vllm-capture-0.log"
    assert "fake vllm: serving" in log.read_text()  # the server's own output goes to its log file
    err = capfd.readouterr().err
    assert f"vLLM server log: {log}" in err and "fake vllm: serving" not in err  # named, not copied
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # and the server is gone
