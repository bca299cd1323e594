import json

import pytest
import torch

from eagle_jobs.capture import run_capture
from eagle_jobs.committed import download_final
from eagle_jobs.errors import BadInput
from eagle_jobs.evaluate.decode import Acceptance, DraftProposer, load_draft, speculative_generate
from eagle_jobs.evaluate.engine import parse_spec_metrics
from eagle_jobs.evaluate.run import check_draft_matches, run_evaluate
from eagle_jobs.extract import run_extract
from eagle_jobs.store import Store
from eagle_jobs.train.run import run_train
from eagle_jobs.verifier import load_verifier


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_kimi):
    """One trained tiny draft shared by this module's tests."""
    import conftest

    tmp = tmp_path_factory.mktemp("ev")
    prompts = conftest.write_prompts(tmp / "p.jsonl")
    from eagle_jobs.recipe import Recipe

    recipe = Recipe.model_validate({
        "name": "tiny", "verifier": {"model": str(tiny_kimi)}, "prompts": {"source": str(prompts), "validation": 2},
        "chat": {"reasoning_parser": "kimi_k2"}, "sampling": {"max_new_tokens": 12},
        "limits": {"max_prompt_tokens": 200, "max_seq_len": 256}, "aux_layer_ids": [1, 2, 3],
        "draft": {"draft_vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
                  "intermediate_size": 128},
        "capture": {"backend": "transformers"}, "extract": {"backend": "transformers"},
        "train": {"epochs": 2, "lr": 1e-3, "optimizer": "adamw", "total_seq_len": 256, "ttt_steps": 2},
        "evaluate": {"backend": "transformers", "num_speculative_tokens": 2, "max_new_tokens": 10},
    })
    st = Store.open(f"file://{tmp}/store")
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    run_train(recipe, st, "r", work_dir=tmp / "w")
    return recipe, st, download_final(st, "r", tmp / "draft")


def _prompt(v, text):
    enc = v.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, thinking=True)
    return list(enc["input_ids"])


@pytest.mark.parametrize("untrained", [False, True])
def test_speculative_output_equals_greedy(trained, untrained):
    recipe, _st, draft = trained
    v = load_verifier(recipe.verifier)
    proposer = DraftProposer(load_draft(draft, v.path, untrained=untrained))
    eos = {v.tokenizer.eos_token_id}
    for text in ["Tell me about the sea #3", "What is two plus two?", "Numbers: 1 2 3"]:
        prompt = _prompt(v, text)
        acc = Acceptance(3)
        got = speculative_generate(v.model, proposer, [1, 2, 3], prompt, 24, eos, acc)
        with torch.no_grad():
            ref = v.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=v.tokenizer.eos_token_id, pad_token_id=v.tokenizer.pad_token_id)
        assert got == ref[0, len(prompt):].tolist()
        assert acc.rounds >= 1 and 1.0 <= acc.tau <= 4.0


def test_acceptance_counting_with_oracle_and_wrong_drafts(trained):
    recipe, _st, _draft = trained
    v = load_verifier(recipe.verifier)
    prompt = _prompt(v, "Write a poem about the sea and the sky.")
    with torch.no_grad():
        ref = v.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=-1,
                               pad_token_id=v.tokenizer.pad_token_id)[0].tolist()

    class Oracle:
        def propose(self, aux, next_ids, k):  # the verifier's own greedy continuation
            n = len(next_ids) + 1
            return ref[n: n + k]

    class Wrong:
        def propose(self, aux, next_ids, k):
            return [ref[len(next_ids) + 1] + 1] * k

    acc = Acceptance(3)
    got = speculative_generate(v.model, Oracle(), [1, 2, 3], prompt, 32, set(), acc)
    assert got == ref[len(prompt): len(prompt) + 32]
    assert acc.tau == 4.0 and acc.per_position() == [1.0, 1.0, 1.0]
    acc2 = Acceptance(3)
    speculative_generate(v.model, Wrong(), [1, 2, 3], prompt, 12, set(), acc2)
    assert acc2.tau == 1.0 and acc2.per_position() == [0.0, 0.0, 0.0] and acc2.rounds == 11


def test_report(trained, tmp_path):
    recipe, st, _ = trained
    rep = run_evaluate(recipe, st, "r")
    for key in ("acceptance_length", "per_position_acceptance", "num_speculative_tokens", "num_prompts",
                "tokens_generated", "verifier", "draft", "baseline_acceptance_length", "teacher_forced_estimate"):
        assert key in rep
    assert rep["num_prompts"] == 2 and rep["num_speculative_tokens"] == 2
    assert len(rep["per_position_acceptance"]) == 2
    files = {k.rsplit("/", 1)[1] for k in st.list("r/eval/data")}
    assert {"report.json", "report.md", "training.png", "acceptance.png", "tau.png"} <= files
    stored = json.loads(st.get("r/eval/data/report.json"))
    assert stored["acceptance_length"] == rep["acceptance_length"]
    # the stored report is the typed record, field for field (eagle_jobs.records; FORMAT.md names each field)
    from eagle_jobs.records import EvalReport, PromptSetResult

    assert set(stored) == set(EvalReport.__annotations__)
    assert all(set(s) == set(PromptSetResult.__annotations__) for s in stored["prompt_sets"].values())
    assert st.get("r/eval/data/tau.png")[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "out"
    p = tmp_path / "extra.jsonl"
    # a real conversation longer than the context is skipped and counted, never sent (vLLM: HTTP 400)
    long = " ".join(["word"] * (recipe.limits.max_prompt_tokens + 10))
    p.write_text('{"messages": [{"role": "user", "content": "Hello!"}]}\n'
                 + json.dumps({"messages": [{"role": "user", "content": long}]}) + "\n")
    rep2 = run_evaluate(recipe, st, "r", prompts=p, output=out)
    assert rep2["num_prompts"] == 1 and (out / "report.md").is_file()
    assert rep2["prompt_sets"]["prompts"]["skipped_too_long"] == 1


def write_traffic(path):
    """Recorded chat-completions requests in the three shapes a recording takes (eagle_jobs/prompts.py):
    a request body, a batch line (OpenAI's Batch API, vLLM's run_batch), a gateway's log record; and one
    request with an image part, which a text draft is not measured on."""
    ctx = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."},
           {"role": "assistant", "content": "Reynard."}, {"role": "user", "content": "And a dog?"}]
    rows = [
        {"model": "served", "messages": ctx, "max_tokens": 64, "temperature": 0.7},
        {"custom_id": "r-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "served", "messages": [{"role": "user", "content": [
             {"type": "text", "text": "Write a poem "}, {"type": "text", "text": "about the sea."}]}]}},
        {"timestamp": "2026-12-06T10:00:00Z", "request": {"model": "served", "messages": [
            {"role": "user", "content": "What is two plus two?"}]}, "response": {"choices": []}},
        {"model": "served", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, ctx


def test_recorded_traffic_is_a_prompt_set_measured_as_it_was_sent(trained, tmp_path):
    from eagle_jobs.evaluate.sets import eval_sets

    recipe, st, _ = trained
    traffic, ctx = write_traffic(tmp_path / "traffic.jsonl")
    ev = recipe.evaluate.model_copy(update={"prompt_sets": {"traffic": str(traffic)}})
    r = recipe.model_copy(update={"evaluate": ev,
                                  "prompts": recipe.prompts.model_copy(update={"max_rejected_fraction": 0.3})})
    sets = eval_sets(r)
    # the request with its context, assistant turn included, as sent; parts joined; the image request left out
    assert sets["traffic"] == [ctx, [{"role": "user", "content": "Write a poem about the sea."}],
                               [{"role": "user", "content": "What is two plus two?"}]]
    rep = run_evaluate(r, st, "r", output=tmp_path / "out")
    t = rep["prompt_sets"]["traffic"]
    assert t["num_prompts"] == 3 and t["source"] == str(traffic) and t["tokens_generated"] > 0
    assert rep["prompt_sets"]["validation"]["num_prompts"] == 2  # the held-out set, reported on its own


def test_prompt_file_with_no_usable_prompt(trained, tmp_path):
    recipe, st, _ = trained
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(BadInput, match="no usable conversation"):
        run_evaluate(recipe, st, "r", prompts=p)


def test_mismatched_draft_rejected(trained):
    recipe, _st, draft = trained
    cfg = json.loads((draft / "config.json").read_text())
    with pytest.raises(BadInput, match="aux layer ids"):
        check_draft_matches(recipe.model_copy(update={"aux_layer_ids": [0, 1, 2]}), cfg, None, None)
    with pytest.raises(BadInput, match="extraction"):
        check_draft_matches(recipe, cfg, [0, 1, 2, 4], None)
    with pytest.raises(BadInput, match="trained for a"):
        check_draft_matches(recipe, cfg, None, ["LlamaForCausalLM"])
    check_draft_matches(recipe, cfg, [1, 2, 3, 4], ["KimiK25ForConditionalGeneration"])


def test_parse_vllm_spec_decode_counters():
    # counter names: vllm/v1/spec_decode/metrics.py (Prometheus adds _total)
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0',
    ])
    m = parse_spec_metrics(text)
    assert m["num_drafts"] == 10 and m["num_accepted_tokens"] == 14 and m["per_pos"] == {0: 8, 1: 4, 2: 2}
    assert 1 + m["num_accepted_tokens"] / m["num_drafts"] == 2.4


def test_drafting_matches_speculators_ttt_forward(trained):
    """At test time the draft must compute what speculators' training forward computes.

    Feeding the training forward our own drafted tokens as the 'teacher' tokens makes
    its TTT step s at the last position see exactly what our step s sees.
    """
    recipe, _st, draft = trained
    v = load_verifier(recipe.verifier)
    model = load_draft(draft, v.path)
    prompt = _prompt(v, "Tell me about the sky #5")
    with torch.no_grad():
        out = v.model(torch.tensor([prompt]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in (1, 2, 3)], dim=-1)
    nxt = int(out.logits[0, -1].argmax())
    next_ids = prompt[1:] + [nxt]
    n, k = len(next_ids), 3
    mine = DraftProposer(model).propose(feats, next_ids, k)
    # training forward over [x_1..x_n, d1, d2] with padding states after position n-1 (causal: unused)
    ids = torch.tensor([next_ids + mine[:-1]])
    hs = torch.cat([feats, torch.zeros(1, k - 1, feats.shape[-1])], dim=1)
    with torch.no_grad():
        drafts = model(hs.float(), ids, torch.zeros_like(ids), ttt_steps=k)
    theirs = [int(d[0, n - 1] + model.d2t[d[0, n - 1]]) for d in drafts]
    assert mine == theirs
    # and the cached proposer gives the same answers as a fresh one after more rounds
    p = DraftProposer(model)
    p.propose(feats[:, :-3], next_ids[:-3], k)
    assert p.propose(feats, next_ids, k) == mine


def test_vllm_backend_reads_spec_decode_counters(trained, tiny_kimi, tmp_path):
    from fake_vllm import FakeVllm

    from eagle_jobs.evaluate.served import evaluate_vllm
    from eagle_jobs.evaluate.sets import eval_prompts

    recipe, _st, draft = trained
    fake = FakeVllm(str(tiny_kimi), reasoning_parser="kimi_k2", spec_tokens=3)
    fake.spec.update(drafts=5, draft_tokens=15, accepted=4, per_pos=[3, 1, 0])  # earlier traffic on the server
    base = fake.start()
    try:
        r = recipe.model_copy(update={"evaluate": recipe.evaluate.model_copy(update={
            "backend": "vllm", "num_speculative_tokens": [3], "vllm": recipe.evaluate.vllm.model_copy(update={
                "endpoint": base, "health_timeout_s": 10})})})
        res = evaluate_vllm(r, draft, eval_prompts(r, None))
    finally:
        fake.stop()
    drafts, acc = fake.spec["drafts"] - 5, fake.spec["accepted"] - 4
    assert drafts > 0 and res["rounds"] == drafts  # only this run's traffic counts
    # an external server: its version from /version, what it chose left to its own log
    assert res["engine"]["engine"] == "vllm" and res["engine"]["version"] == fake.version
    assert res["engine"]["model_runner"].startswith("not seen: an external server")
    assert res["acceptance_length"] == pytest.approx(1 + acc / drafts)
    assert res["per_position_acceptance"][2] == 0.0
    assert res["per_position_acceptance"][0] == pytest.approx((fake.spec["per_pos"][0] - 3) / drafts)
    assert res["tokens_generated"] > 0


def test_vllm_backend_starts_servers_for_draft_baseline_and_no_draft(trained, monkeypatch):
    import os
    import sys
    from pathlib import Path

    from conftest import free_port

    recipe, st, _draft = trained
    monkeypatch.setenv("PATH", f"{Path(__file__).parent / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("EAGLE_JOBS_TEST_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    monkeypatch.delenv("EAGLE_JOBS_VLLM_ENDPOINT", raising=False)
    r = recipe.model_copy(update={"evaluate": recipe.evaluate.model_copy(update={
        "backend": "vllm",
        "vllm": recipe.evaluate.vllm.model_copy(update={"port": free_port(), "health_timeout_s": 120})})})
    rep = run_evaluate(r, st, "r", output=Path(st.root) / "vllm-eval")
    assert rep["backend"] == "vllm" and rep["baseline_acceptance_length"] is not None
    assert rep["acceptance_length"] >= 1.0 and len(rep["per_position_acceptance"]) == 2
    # and a third server, without --speculative-config, for the speed without a draft
    levels = rep["speedup"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 8] and [lv["requests"] for lv in levels] == [4, 8]
    assert all(lv["with_draft"]["output_tokens"] == lv["without_draft"]["output_tokens"] > 0 for lv in levels)


def test_the_speculative_defaults_an_engine_record_names_are_the_installed_vllms():
    """evaluate.engine.VLLM_SPEC_DEFAULTS is what our --speculative-config leaves to vLLM: read from the installed
    wheel, so a vLLM that changes a default changes this test, not a τ silently."""
    from vllm.config.speculative import SpeculativeConfig

    from eagle_jobs.evaluate.engine import VLLM_SPEC_DEFAULTS

    fields = SpeculativeConfig.__dataclass_fields__
    assert {k: fields[k].default for k in VLLM_SPEC_DEFAULTS} == VLLM_SPEC_DEFAULTS
