import pytest
import torch

from eagle_jobs import extract as ex_mod
from eagle_jobs import sharding
from eagle_jobs.capture import run_capture
from eagle_jobs.committed import RowRef, extraction_info, read_rows, read_sample
from eagle_jobs.errors import BadInput
from eagle_jobs.extract import run_extract
from eagle_jobs.records import Extracted, RowStates
from eagle_jobs.store import Stage, Store
from eagle_jobs.verifier import load_verifier


def _captured(recipe, uri, run="r"):
    st = Store.open(uri)
    st.check()
    run_capture(recipe, st, run)
    return st


def test_auto_storage_is_fp8_above_the_recipes_size_and_bf16_below(tiny_recipe, tmp_path):
    """extract.storage_dtype auto (the default): the corpus's bf16 size against extract.fp8_above_bytes,
    resolved from the committed rows, recorded in the manifests, matched by reuse as the dtype it became."""
    from eagle_jobs.hsformat import bytes_per_token, resolve_storage
    from eagle_jobs.reuse import extract_digest

    bf16 = tiny_recipe(extract={"shard_bytes": 10**9})
    assert bf16.extract.storage_dtype == "auto"
    st = _captured(bf16, f"file://{tmp_path}/s")
    tokens = sum(len(r["input_ids"]) for r in read_rows(st, "r"))
    size = tokens * bytes_per_token(4, 64, "bfloat16")
    assert [resolve_storage("auto", tokens, 4, 64, n) for n in (size, size - 1)] == ["bfloat16", "fp8"]
    assert resolve_storage("bfloat16", tokens, 4, 64, 1) == "bfloat16"  # a dtype the recipe names is kept
    run_extract(bf16, st, "r")
    assert extraction_info(st, "r")["storage"] == "bfloat16"
    fp8 = tiny_recipe(extract={"shard_bytes": 10**9, "fp8_above_bytes": size - 1})
    st8 = _captured(fp8, f"file://{tmp_path}/s8")
    run_extract(fp8, st8, "r")
    (m,) = extraction_info(st8, "r")["manifests"]
    assert m["storage"] == "fp8" and m["settings_digest"] == extract_digest(fp8.with_storage("fp8"))
    assert sum(e["length"] for e in m["samples"]) == sum(e["num_tokens"] for e in m["samples"]) * (4 * 64 + 4 * 4 + 9)


def test_states_match_vllm_definition_and_reproduce_logits(tiny_recipe, store_uri):
    recipe = tiny_recipe()
    st = _captured(recipe, store_uri)
    run_extract(recipe, st, "r")
    info = extraction_info(st, "r")
    assert info["layer_ids"] == [1, 2, 3, 4] and len(info["manifests"]) > 1  # several shards
    model = load_verifier(recipe.verifier).model
    rows = {r["row_id"]: r for r in read_rows(st, "r")}
    seen = 0
    for m in info["manifests"]:
        for e in m["samples"]:
            s = read_sample(st, "r", m, e, torch.float32)
            ids = rows[e["row_id"]]["input_ids"]
            assert s["token_ids"].tolist() == ids
            assert s["loss_mask"].tolist() == [bool(x) for x in rows[e["row_id"]]["loss_mask"]]
            with torch.no_grad():
                out = model(torch.tensor([ids]), output_hidden_states=True)
            hs = s["hidden_states"]
            for j, k in enumerate([1, 2, 3]):  # aux id k == HF hidden_states[k]
                torch.testing.assert_close(hs[:, j], out.hidden_states[k][0], rtol=2e-2, atol=2e-2)
            # final entry is pre-norm: the verifier's norm + lm_head reproduce its logits
            logits = model.lm_head(model.model.norm(hs[:, 3]))
            torch.testing.assert_close(logits, out.logits[0], rtol=5e-2, atol=5e-2)
            assert (logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean() > 0.95
            seen += 1
    assert seen == len(rows)


def test_one_sample_is_one_range_read(tiny_recipe, tmp_path, monkeypatch):
    recipe = tiny_recipe()
    st = _captured(recipe, f"file://{tmp_path}/s")
    run_extract(recipe, st, "r")
    m = extraction_info(st, "r")["manifests"][0]
    calls = []
    orig = Store.get
    monkeypatch.setattr(Store, "get", lambda self, k, a=None, b=None: calls.append((a, b)) or orig(self, k, a, b))
    e = m["samples"][-1]
    read_sample(st, "r", m, e)
    size = m["files"][next(iter(m["files"]))]["size"]
    assert calls == [(e["start"], e["start"] + e["length"])] and e["length"] < size


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
def test_a_sample_read_into_a_bytearray_decodes_in_place(tiny_recipe, tmp_path, storage):
    """The trainer reads each staged sample into a bytearray and its tensors share that memory: a Kimi-size
    sample (470 MB) is not copied again, which data loading's share of a GPU step (57%, benchmarks/) asks."""
    import ctypes

    from eagle_jobs.hsformat import decode_sample

    recipe = tiny_recipe(extract={"storage_dtype": storage})
    st = _captured(recipe, f"file://{tmp_path}/s")
    run_extract(recipe, st, "r")
    m = extraction_info(st, "r")["manifests"][0]
    e = m["samples"][-1]
    raw = st.get(Stage(st, "r", "extract").key(f"data/{next(iter(m['files']))}"), e["start"], e["start"] + e["length"])
    buf = bytearray(raw)
    copied, in_place = decode_sample(raw, e), decode_sample(buf, e)
    for name in ("hidden_states", "token_ids", "loss_mask"):
        assert torch.equal(copied[name], in_place[name]), name
    base = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    shared = in_place["token_ids"] if storage == "fp8" else in_place["hidden_states"]  # fp8 is scaled: a new tensor
    assert base <= shared.data_ptr() < base + len(buf)
    assert not base <= copied["token_ids"].data_ptr() < base + len(buf)  # bytes are read-only: copied


def test_bytes_per_token(tiny_recipe, tmp_path):
    recipe = tiny_recipe(extract={"shard_bytes": 10**9})
    st = _captured(recipe, f"file://{tmp_path}/s")
    run_extract(recipe, st, "r")
    (m,) = extraction_info(st, "r")["manifests"]
    tokens = sum(e["num_tokens"] for e in m["samples"])
    data = sum(e["length"] for e in m["samples"])
    assert data == tokens * (4 * 64 * 2 + 8 + 1)  # layers x hidden x bf16, + int64 id + u8 mask
    size = next(iter(m["files"].values()))["size"]
    assert size - data < 0.05 * size  # the rest is the safetensors header


def test_fp8_storage(tiny_recipe, tmp_path):
    recipe = tiny_recipe(extract={"storage_dtype": "fp8", "shard_bytes": 10**9})
    st = _captured(recipe, f"file://{tmp_path}/s")
    run_extract(recipe, st, "r")
    (m,) = extraction_info(st, "r")["manifests"]
    tokens = sum(e["num_tokens"] for e in m["samples"])
    assert sum(e["length"] for e in m["samples"]) == tokens * (4 * 64 + 4 * 4 + 8 + 1)
    model = load_verifier(recipe.verifier).model
    e = m["samples"][0]
    s = read_sample(st, "r", m, e, torch.float32)
    with torch.no_grad():
        out = model(s["token_ids"][None], output_hidden_states=True)
    ref = out.hidden_states[2][0]
    rel = (s["hidden_states"][:, 1] - ref).norm() / ref.norm()
    assert rel < 0.06


def test_bad_records_are_skipped_and_reported(tiny_recipe, tmp_path, monkeypatch):
    recipe = tiny_recipe()
    st = _captured(recipe, f"file://{tmp_path}/s")
    real = ex_mod.TransformersExtractor.states

    def corrupt(self, rows, advance):
        out = real(self, rows, advance).states
        if "00000001-00" in out:
            hs, t = out["00000001-00"]
            hs = hs.clone()
            hs[0, 0, 0] = float("nan")
            out["00000001-00"] = RowStates(hs, t)
        if "00000002-00" in out:
            hs, t = out["00000002-00"]
            out["00000002-00"] = RowStates(hs, [9] + list(t[1:]))
        if "00000003-00" in out:
            hs, t = out["00000003-00"]
            out["00000003-00"] = RowStates(hs[:-1], t)  # truncated record
        return Extracted(out, {})

    monkeypatch.setattr(ex_mod.TransformersExtractor, "states", corrupt)
    s = run_extract(recipe, st, "r")
    assert s["skipped"] == 3
    info = extraction_info(st, "r")
    reasons = {k["row_id"]: k["reason"] for m in info["manifests"] for k in m["skipped"]}
    assert "NaN" in reasons["00000001-00"] and "token ids" in reasons["00000002-00"]
    assert "truncated" in reasons["00000003-00"]
    stored = {e["row_id"] for m in info["manifests"] for e in m["samples"]}
    assert not stored & set(reasons)


def test_restart_resumes_at_first_uncommitted_shard(tiny_recipe, tmp_path, monkeypatch):
    recipe = tiny_recipe()
    st = _captured(recipe, f"file://{tmp_path}/s")
    real = ex_mod._pack_and_commit
    n = {"c": 0}

    def dying(*a, **kw):
        n["c"] += 1
        if n["c"] == 3:
            raise RuntimeError("pod evicted")
        return real(*a, **kw)

    monkeypatch.setattr(ex_mod, "_pack_and_commit", dying)
    with pytest.raises(RuntimeError):
        run_extract(recipe, st, "r")
    stage = Stage(st, "r", "extract")
    done_before = [m["shard"] for m in stage.manifests()]
    assert len(done_before) == 2 and not stage.is_complete()
    monkeypatch.setattr(ex_mod, "_pack_and_commit", real)
    calls = []
    monkeypatch.setattr(ex_mod, "_pack_and_commit", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    run_extract(recipe, st, "r")
    assert stage.is_complete() and not set(calls) & set(done_before)
    rows = [e["row_id"] for m in stage.manifests() for e in m["samples"]]
    assert sorted(rows) == sorted(r["row_id"] for r in read_rows(st, "r"))


def test_aux_ids_out_of_range_rejected_before_weights_load(tiny_recipe, tmp_path, monkeypatch):
    recipe = tiny_recipe(aux_layer_ids=[1, 2, 9])
    monkeypatch.setattr("eagle_jobs.verifier.load_verifier", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(BadInput, match=r"\[9\] out of range for a verifier with 4 layers"):
        run_extract(recipe, Store.open(f"file://{tmp_path}/s"), "r")


def test_vllm_backend_against_extract_hidden_states_server(tiny_recipe, tiny_kimi, tmp_path):
    from fake_vllm import FakeVllm

    scratch = tmp_path / "scratch"
    recipe = tiny_recipe(extract={"backend": "vllm", "scratch_dir": str(scratch), "concurrency": 4})
    st = _captured(recipe, f"file://{tmp_path}/s")
    fake = FakeVllm(str(tiny_kimi), layer_ids=[1, 2, 3, 4], scratch=scratch / "r-0", drop_first=2)
    (scratch / "r-0").mkdir(parents=True)
    base = fake.start()
    try:
        recipe = tiny_recipe(extract={"backend": "vllm", "scratch_dir": str(scratch), "concurrency": 4,
                                      "vllm": {"endpoint": base, "health_timeout_s": 10}})
        run_extract(recipe, st, "r")
    finally:
        fake.stop()
    assert list((scratch / "r-0").iterdir()) == []  # every file read, packed and deleted
    st2 = _captured(tiny_recipe(), f"file://{tmp_path}/s2")
    run_extract(tiny_recipe(), st2, "r")
    a, b = extraction_info(st, "r")["manifests"], extraction_info(st2, "r")["manifests"]
    assert [e["row_id"] for m in a for e in m["samples"]] == [e["row_id"] for m in b for e in m["samples"]]
    for ma, mb in zip(a, b):
        for ea, eb in zip(ma["samples"], mb["samples"]):
            x = read_sample(st, "r", ma, ea, torch.float32)["hidden_states"]
            y = read_sample(st2, "r", mb, eb, torch.float32)["hidden_states"]
            torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


def test_vllm_serve_arguments(tiny_recipe, tmp_path):
    import json

    from eagle_jobs import vllm_cpu
    from eagle_jobs.serve_plans import extract_args

    recipe = tiny_recipe(extract={"scratch_dir": str(tmp_path)})
    args = extract_args(recipe, "r", 1)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert (kv["kv_role"] == "kv_producer"
            and kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "r-1"))
    assert {k: kv[k] for k in vllm_cpu.hidden_states_connector()} == vllm_cpu.hidden_states_connector()
    assert "--no-enable-chunked-prefill" in args
    # fp8 storage: vLLM still writes the model dtype, and only the shard encoder quantises (once, per
    # token and layer); hs-connectors' fp8 connector would quantise per token over all layers first
    fp8 = extract_args(tiny_recipe(extract={"storage_dtype": "fp8", "scratch_dir": str(tmp_path)}), "r", 1)
    assert fp8 == args


def test_fp8_shards_quantise_vllm_states_once(tiny_recipe, tiny_kimi, tmp_path):
    """fp8 storage through the vllm backend equals the shard encoder's one quantisation of the states."""
    from fake_vllm import FakeVllm

    from eagle_jobs.hsformat import quantize_fp8

    scratch = tmp_path / "scratch"
    recipe = tiny_recipe(extract={"backend": "vllm", "scratch_dir": str(scratch), "storage_dtype": "fp8"})
    st = _captured(recipe, f"file://{tmp_path}/s")
    fake = FakeVllm(str(tiny_kimi), layer_ids=[1, 2, 3, 4], scratch=scratch / "r-0")
    base = fake.start()
    try:
        run_extract(tiny_recipe(extract={"backend": "vllm", "scratch_dir": str(scratch), "storage_dtype": "fp8",
                                         "vllm": {"endpoint": base}}), st, "r")
    finally:
        fake.stop()
    rows = {r["row_id"]: r for r in read_rows(st, "r")}
    m = extraction_info(st, "r")["manifests"][0]
    e = m["samples"][0]
    stored = read_sample(st, "r", m, e, torch.float32)["hidden_states"]
    q, scale = quantize_fp8(fake._hidden_states(rows[e["row_id"]]["input_ids"]))
    torch.testing.assert_close(stored, q.float() * scale.unsqueeze(-1), rtol=0, atol=0)


def test_lock_never_released_times_out_with_one_line_and_commits_nothing(tiny_recipe, tiny_kimi, tmp_path):
    from fake_vllm import FakeVllm

    from eagle_jobs.errors import Unavailable

    scratch = tmp_path / "scratch"
    st = _captured(tiny_recipe(), f"file://{tmp_path}/s")
    fake = FakeVllm(str(tiny_kimi), layer_ids=[1, 2, 3, 4], scratch=scratch / "r-0", write_delay_s=None)
    base = fake.start()
    try:
        recipe = tiny_recipe(extract={"backend": "vllm", "scratch_dir": str(scratch), "concurrency": 2,
                                      "vllm": {"endpoint": base, "request_timeout_s": 1.0}})
        with pytest.raises(Unavailable,
                           match=r"hidden-states file .*\.safetensors: still locked by vLLM after 1s") as e:
            run_extract(recipe, st, "r")
        assert "\n" not in str(e.value)
        stage = Stage(st, "r", "extract")
        assert stage.manifests() == [] and not stage.is_complete()
        # what a stuck writer holds is left alone; once released, the next attempt sweeps it away
        held = sorted(p.name for p in (scratch / "r-0").iterdir())
        assert held and ex_mod.sweep_scratch(scratch / "r-0") == 0
    finally:
        fake.stop()
    for fd in fake.held_locks:
        import os

        os.close(fd)
    (scratch / "r-0" / "orphan.safetensors").write_bytes(b"x")
    assert ex_mod.sweep_scratch(scratch / "r-0") == len(held) + 1  # the released locks and an orphan file
    assert sorted(p.name for p in (scratch / "r-0").iterdir()) == []


def test_shards_hold_rows_of_similar_length_and_pad_little():
    """A shard is batched on its own, so the plan groups rows by length; the plan does not depend on
    the order rows arrive in (a restarted worker plans the same shards)."""
    import random

    rnd = random.Random(0)
    rows = [{"row_id": f"{i:04d}", "input_ids": [0] * rnd.randint(50, 400)} for i in range(200)]
    refs = [RowRef(r["row_id"], "train", len(r["input_ids"]), 1, "s", 0, 0) for r in rows]
    by_id = {r["row_id"]: r for r in rows}
    plan = [[by_id[r.row_id] for r in s] for s in sharding.plan_shards(refs, 100, 100 * 6000)]
    assert sorted(r["row_id"] for s in plan for r in s) == sorted(r["row_id"] for r in rows)
    assert all(max(len(r["input_ids"]) for r in a) <= min(len(r["input_ids"]) for r in b)
               for a, b in zip(plan, plan[1:]))
    assert sharding.plan_shards(list(reversed(refs)), 100, 100 * 6000) == sharding.plan_shards(refs, 100, 100 * 6000)

    def padded(batches):
        return sum(len(b) * max(len(r["input_ids"]) for r in b) for b in batches)

    # no more padded tokens than batching all rows at once (what bench_extract's bare forward does)
    per_shard = sum(padded(ex_mod.batches_by_tokens(s, 2048)) for s in plan)
    assert per_shard <= padded(ex_mod.batches_by_tokens(rows, 2048))
