import os
import subprocess
import sys

import pytest

from eagle_jobs.errors import StoreError
from eagle_jobs.store import Stage, Store, sha256


def test_commit_protocol(store_uri):
    st = Store.open(store_uri)
    st.check()
    stage = Stage(st, "run1", "capture")
    assert stage.manifests() == [] and not stage.is_complete()
    m = stage.commit_shard("a", {"a.jsonl": b"x" * 10}, {"rows": 1})
    assert m["files"]["a.jsonl"] == {"size": 10, "sha256": sha256(b"x" * 10)}
    # a shard object without its manifest is not committed
    st.put(stage.key("data/b.jsonl"), b"partial")
    assert stage.is_committed("a") and not stage.is_committed("b")
    assert [m["shard"] for m in stage.manifests()] == ["a"]
    assert [d for _m, _f, d in stage.iter_objects()] == [b"x" * 10]
    assert stage.mark_worker_done(0, 2, {}) is False and not stage.is_complete()
    assert stage.mark_worker_done(1, 2, {}) is True and stage.is_complete()
    assert st.url(stage.prefix).endswith("run1/capture")


def test_manifest_whose_object_is_short_is_not_committed(store_uri):
    st = Store.open(store_uri)
    stage = Stage(st, "r", "extract")
    stage.commit_shard("s", {"s.bin": b"abcdef"}, {})
    st.put(stage.key("data/s.bin"), b"abc")  # truncated by someone
    assert not stage.is_committed("s")


def test_range_reads(store_uri):
    st = Store.open(store_uri)
    st.put("k/obj", bytes(range(256)))
    assert st.get("k/obj", 10, 20) == bytes(range(10, 20))


def test_large_objects_use_parallel_multipart(bucket, monkeypatch):
    st = Store.open(f"s3://{bucket}/p")
    calls = []
    orig = st.fs._call_s3

    async def spy(method, *a, **kw):
        calls.append(method)
        return await orig(method, *a, **kw)

    monkeypatch.setattr(st.fs, "_call_s3", spy)
    data = os.urandom(12 * 1024**2)  # > EAGLE_JOBS_MULTIPART_BYTES (6 MiB in tests)
    st.put("big.bin", data)
    assert calls.count("upload_part") == 3 and "complete_multipart_upload" in calls
    assert st.get("big.bin") == data


def test_transient_errors_are_retried(tmp_path, monkeypatch):
    st = Store.open(f"file://{tmp_path}")
    st.put("x", b"1")
    fails = {"n": 2}
    orig = st.fs.cat_file

    def flaky(*a, **kw):
        if fails["n"]:
            fails["n"] -= 1
            raise ConnectionResetError("reset by peer")
        return orig(*a, **kw)

    monkeypatch.setattr(st.fs, "cat_file", flaky)
    assert st.get("x") == b"1" and fails["n"] == 0


def test_missing_bucket_fails_at_once(moto_server):
    with pytest.raises(StoreError, match="does not exist"):
        Store.open("s3://no-such-bucket-here/x").check()


def test_bad_credentials_fail_at_once(bucket, moto_server):
    """moto's documented auth switch: after POST /moto-api/reset-auth 0, unknown keys are rejected."""
    import httpx

    httpx.post(f"{moto_server}/moto-api/reset-auth", content=b"0").raise_for_status()
    try:
        with pytest.raises(StoreError, match="denied"):
            Store.open(f"s3://{bucket}/x").check()
    finally:
        httpx.post(f"{moto_server}/moto-api/reset-auth", content=b"inf").raise_for_status()


def test_cli_missing_bucket_one_line(moto_server, tmp_path):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "jobs/demo.yaml"
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "capture", "--recipe", str(recipe),
                        "--store", "s3://absent-bucket/x"], capture_output=True, text=True, timeout=120,
                       env={**os.environ})
    assert r.returncode == 4, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "absent-bucket" in lines[0]


def test_a_key_written_by_another_process_after_a_listing_is_read(bucket):
    """s3fs's listings cache answered reads from a stale listing: a key another writer committed after
    this process listed the prefix raised FileNotFoundError (found in the step-checkpoint resume test)."""
    reader, writer = Store.open(f"s3://{bucket}/runs"), Store.open(f"s3://{bucket}/runs")
    writer.put("r/train/manifests/a.json", b"{}")
    assert reader.list("r/train/manifests")  # the reader lists the prefix (and would cache it)
    writer.put("r/train/manifests/b.json", b'{"b": 1}')
    assert reader.get("r/train/manifests/b.json") == b'{"b": 1}'
    assert reader.exists("r/train/manifests/b.json")
