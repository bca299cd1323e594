"""Incremental retraining: a larger prompt set reuses what an earlier run committed."""

import json

import torch

from eagle_jobs import capture as capture_mod
from eagle_jobs import extract as extract_mod
from eagle_jobs.capture import run_capture
from eagle_jobs.committed import extraction_info, read_rows, read_sample
from eagle_jobs.extract import run_extract
from eagle_jobs.plan import print_plan
from eagle_jobs.store import Store


def test_larger_prompt_set_reuses_rows_and_states(tiny_recipe, tmp_path, monkeypatch):
    import conftest

    small = tiny_recipe()
    st = Store.open(f"file://{tmp_path}/store")
    run_capture(small, st, "v1")
    run_extract(small, st, "v1")
    # v2: the same 12 conversations shuffled behind 4 new ones
    old = [json.loads(ln) for ln in open(small.prompts.source)]
    new = [json.loads(ln) for ln in open(conftest.write_prompts(tmp_path / "new.jsonl", n=16, multi_turn_every=0))][12:]
    big_src = tmp_path / "big.jsonl"
    big_src.write_text("".join(json.dumps(o) + "\n" for o in new + old[::-1]))
    big = tiny_recipe(prompts={"source": str(big_src), "validation": 0.2})
    plan = print_plan(big, st, "v2")
    assert plan["reuse"]["capture_reused"] == 12 and plan["reuse"]["from_runs"] == ["v1"]
    assert plan["reuse"]["hidden_state_tokens_reused"] > 0

    generated, forwarded = [], []
    real_run, real_states = capture_mod.TransformersBackend.run, extract_mod.TransformersExtractor.states
    monkeypatch.setattr(capture_mod.TransformersBackend, "run",
                        lambda self, convs, *a: generated.extend(convs) or real_run(self, convs, *a))
    monkeypatch.setattr(extract_mod.TransformersExtractor, "states",
                        lambda self, rows, *a: forwarded.extend(rows) or real_states(self, rows, *a))
    s = run_capture(big, st, "v2")
    assert s["reused_conversations"] == 12 and len(generated) == 4
    e = run_extract(big, st, "v2")
    assert e["reused_samples"] == len(read_rows(st, "v2")) - len(forwarded) and len(forwarded) == 4

    # reused data is what a fresh computation gives
    fresh = Store.open(f"file://{tmp_path}/fresh")
    monkeypatch.setattr(capture_mod.TransformersBackend, "run", real_run)
    monkeypatch.setattr(extract_mod.TransformersExtractor, "states", real_states)
    run_capture(big, fresh, "v2")
    run_extract(big, fresh, "v2")
    a, b = read_rows(st, "v2"), read_rows(fresh, "v2")
    assert ([(r["row_id"], r["input_ids"], r["split"]) for r in a]
            == [(r["row_id"], r["input_ids"], r["split"]) for r in b])
    ma, mb = extraction_info(st, "v2")["manifests"], extraction_info(fresh, "v2")["manifests"]
    for x, y in zip(ma, mb):
        for ex, ey in zip(x["samples"], y["samples"]):
            assert ex["ids_sha256"] == ey["ids_sha256"]
            torch.testing.assert_close(read_sample(st, "v2", x, ex)["hidden_states"],
                                       read_sample(fresh, "v2", y, ey)["hidden_states"], rtol=2e-2, atol=2e-2)


def test_serving_backend_and_dtype_are_part_of_the_fingerprints(tiny_recipe):
    """An fp32 run once reused rows a bf16 vLLM server had captured: who computed them counts."""
    from eagle_jobs.reuse import capture_digest, extract_digest

    def recipe(stage, backend, *args):
        return tiny_recipe(**{stage: {"backend": backend, "vllm": {"serve_args": list(args)}}})

    for stage, digest in (("capture", capture_digest), ("extract", extract_digest)):
        fp32 = digest(recipe(stage, "vllm", "--dtype", "float32"))
        assert fp32 == digest(recipe(stage, "vllm", "--max-model-len", "512", "--dtype=float32"))
        assert fp32 != digest(recipe(stage, "vllm", "--dtype", "bfloat16"))
        assert fp32 != digest(recipe(stage, "transformers"))
        assert digest(recipe(stage, "vllm")) != fp32  # auto: the checkpoint's dtype


def test_other_settings_are_not_reused(tiny_recipe, tmp_path):
    st = Store.open(f"file://{tmp_path}/store")
    run_capture(tiny_recipe(), st, "a")
    s = run_capture(tiny_recipe(sampling={"temperature": 0.0, "max_new_tokens": 8}), st, "b")
    assert s["reused_conversations"] == 0
