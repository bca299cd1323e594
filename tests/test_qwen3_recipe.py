"""Your own model: jobs/qwen3-8b.yaml (Qwen3-8B, thinking mode) and k8s/overlays/qwen3-8b-1gpu.

The overlay renders one GPU a pod on an H100 or H200 pool and carries the recipe as it is in jobs/; `plan`
prices the recipe with the draft shape Qwen3-8B's config derives; and the recipe itself, with only the
model, the sizes and the backends made small, runs capture -> extract -> train -> evaluate through the CLI
on a tiny Qwen3 built here (Qwen3ForCausalLM, random weights, the embedded SmolLM2's tokenizer), its
prompt file made by `eagle-jobs prompts build`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import embedded_smollm2_except, kustomize, write_prompts
from k8s_helpers import gfd_product, node, schedulable

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "jobs/qwen3-8b.yaml"
OVERLAY = REPO / "k8s/overlays/qwen3-8b-1gpu"
STAGES = ("capture", "extract", "train", "evaluate")
VLLM_STAGES = ("capture", "extract", "evaluate")
# Qwen/Qwen3-8B's config.json (the text model) at the recipe's pinned revision: the numbers the draft derives from
QWEN3_8B = {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}


def _aux_rule(n: int) -> list[int]:
    """vLLM's EAGLE-3 default aux layers for an n-layer model (vllm 0.32 model_executor/models/interfaces.py
    get_eagle3_default_aux_hidden_state_layers: 2, n // 2, n - 3)."""
    return [2, n // 2, n - 3]


# -- the overlay ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return kustomize(OVERLAY)


def _pods(docs) -> dict[str, dict]:
    js = next(d for d in docs if d["kind"] == "JobSet")
    return {rj["name"]: rj["template"]["spec"]["template"]["spec"] for rj in js["spec"]["replicatedJobs"]}


def _gpus(c: dict) -> int:
    return int(c["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_the_overlay_gives_each_stage_one_gpu_of_an_h100_or_h200_node_and_carries_the_recipe(rendered):
    from eagle_jobs.recipe_file import recipe_from_text

    pods = _pods(rendered)
    assert list(pods) == ["mirror", *STAGES, "guard"]
    (cm,) = [d for d in rendered if d["kind"] == "ConfigMap" and "recipe.yaml" in d.get("data", {})]
    text = cm["data"]["recipe.yaml"]
    assert text == RECIPE.read_text() == (OVERLAY / "recipe.yaml").read_text(), "run `make k8s-recipes`"
    recipe = recipe_from_text(text, "the ConfigMap", "s3://eagle-jobs")  # as the pods read it
    assert recipe.verifier.weights == f"s3://eagle-jobs/models/Qwen/Qwen3-8B/{recipe.verifier.revision}"
    assert recipe.plan.gpus_per_node == recipe.train.nproc_per_node * recipe.train.nnodes == 1
    h100, h200 = gfd_product("NVIDIA H100 80GB HBM3"), gfd_product("NVIDIA H200")
    assert (h100, h200) == ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H200")
    for stage in STAGES:
        pod = pods[stage]
        running = pod["containers"] + [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        assert sum(_gpus(c) for c in running) == 1, stage
        if stage in VLLM_STAGES:  # the GPU is the vLLM sidecar's, at tensor parallelism 1; the worker asks none
            (side,) = [c for c in pod["initContainers"] if c["name"] == "vllm"]
            assert _gpus(side) == 1 and _gpus(pod["containers"][0]) == 0
            args = getattr(recipe, stage).vllm.serve_args
            assert "--tensor-parallel-size" not in args and "-tp" not in args
        # one GPU of any node of these products (8-GPU HGX included), never another product, arch or old driver
        for product in (h100, h200):
            for count in (1, 8):
                assert schedulable(pod, {**node("x", count, "amd64", 580), "nvidia.com/gpu.product": product}), stage
        for other in ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA B200", "NVIDIA A100-SXM4-80GB"):
            assert not schedulable(pod, node(other, 8, "amd64", 580)), (stage, other)
        assert not schedulable(pod, node("NVIDIA GH200 480GB", 1, "arm64", 580))  # the train image is amd64 only
        assert not schedulable(pod, node("NVIDIA H100 80GB HBM3", 8, "amd64", 575))  # CUDA 13 needs R580
        # an eighth of an 8-GPU node's CPU and memory with the GPU; /dev/shm is charged to that memory
        gpu_c = next(c for c in running if _gpus(c))
        assert gpu_c["resources"]["limits"]["cpu"] == "8" and gpu_c["resources"]["limits"]["memory"] == "96Gi"
        memory = sum(float(c["resources"]["limits"]["memory"].removesuffix("Gi")) for c in running)
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        assert float(shm.removesuffix("Gi")) < memory, (stage, shm, memory)


# -- the plan --------------------------------------------------------------------------------------------

def test_the_recipe_plans_the_qwen3_8b_draft_and_vllm_serves_it_as_stated(tmp_path):
    """`plan` reads no hub config: it prices the draft from the recipe's stated keys, which equal what
    Qwen3-8B's own config derives when training reads it; the served thinking mode is vLLM's qwen3 parser."""
    from transformers import Qwen3Config
    from typer.testing import CliRunner

    from eagle_jobs.cli import app
    from eagle_jobs.draft import resolve_shape
    from eagle_jobs.plan import make_plan
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.serve_plans import capture_plan, evaluate_plan

    recipe = load_recipe(RECIPE)
    out = CliRunner().invoke(app, ["plan", "--recipe", str(RECIPE), "--json"])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.stdout)
    assert plan == json.loads(json.dumps(make_plan(recipe)))
    shape = dict(kv.split("=") for kv in plan["draft_shape"].split(" (derived")[0].split(", "))
    assert shape == {"num_layers": "1", "hidden_size": "4096", "num_attention_heads": "32",
                     "num_key_value_heads": "8", "head_dim": "128", "intermediate_size": "12288",
                     "draft_vocab_size": "32000", "verifier_vocab_size": shape["verifier_vocab_size"],
                     "verifier_num_layers": "36"}
    assert plan["stored_layers"] == 4 and plan["gpus_for_training"] == 1 and plan["storage"] == "fp8"
    assert recipe.aux_layer_ids == _aux_rule(recipe.verifier.num_layers) == [2, 18, 33]
    scale = CliRunner().invoke(app, ["plan", "--recipe", str(RECIPE), "--scale", "20000"])
    assert scale.exit_code == 0 and "stored" in scale.output, scale.output
    # training reads the verifier's config: with the stated keys unset, Qwen3-8B's own numbers give the same draft
    cfg = Qwen3Config(**QWEN3_8B)
    derived = recipe.model_copy(update={"draft": recipe.draft.model_copy(
        update={"hidden_size": None, "num_key_value_heads": None})})
    real, stated = resolve_shape(derived, cfg), resolve_shape(recipe, cfg)
    assert real.describe().split(" (derived")[0] == stated.describe().split(" (derived")[0]
    assert (real.num_key_value_heads, real.head_dim, real.verifier_vocab_size) == (8, 128, 151936)
    # the vLLM servers: the thinking mode parsed by vLLM's qwen3 parser, one GPU, the draft as EAGLE-3 at k 3
    vllm_init = Path(importlib.util.find_spec("vllm").origin).parent / "reasoning" / "__init__.py"
    assert '"qwen3": (' in vllm_init.read_text()  # the parser the recipe names is registered in this vLLM
    # (vLLM streams the weights from the store's mirror: a local one stands in for the bucket)
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror/MIRROR.json").write_text(json.dumps(
        {"model": recipe.verifier.model, "revision": recipe.verifier.revision, "files": {}, "bytes": 0}))
    recipe = recipe.model_copy(update={"verifier": recipe.verifier.model_copy(
        update={"weights": f"file://{tmp_path}/mirror"})})
    cap = capture_plan(recipe).command()
    assert cap[cap.index("--reasoning-parser") + 1] == "qwen3" and cap[cap.index("--max-model-len") + 1] == "8192"
    ev = evaluate_plan(recipe, tmp_path / "draft").command()
    spec = json.loads(ev[ev.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    assert "--tensor-parallel-size" not in ev and ev[ev.index("--reasoning-parser") + 1] == "qwen3"
    # what the long-output set asks of the server fits its --max-model-len
    lo = recipe.evaluate.long_output
    assert recipe.limits.max_prompt_tokens + lo.max_new_tokens <= int(ev[ev.index("--max-model-len") + 1])


# -- end to end on a tiny Qwen3 ---------------------------------------------------------------------------

TINY_LAYERS = 8  # the aux rule 2, n//2, n-3 gives three distinct layers from 8 up


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A Qwen3ForCausalLM laid out as Qwen/Qwen3-8B is (grouped-query attention, heads x head_dim = hidden,
    an untied head, rope theta 1e6), 8 layers of width 64, random weights; the embedded SmolLM2's tokenizer
    and chat template."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dst = tmp_path_factory.mktemp("qwen3-tiny")
    embedded_smollm2_except(dst, "config.json")
    for name in ("model.safetensors", "generation_config.json"):  # the tokenizer and chat template stay
        (dst / name).unlink()
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(dst)
    return dst


def _tiny_recipe(model: Path, store: str, prompts: str) -> dict:
    """jobs/qwen3-8b.yaml with the model, the sizes and the backends made small; every other setting as shipped."""
    r = yaml.safe_load(RECIPE.read_text())
    r["verifier"] = {**{k: v for k, v in r["verifier"].items() if k not in ("revision", "weights")},
                     "model": str(model), "num_layers": TINY_LAYERS}
    r["prompts"].update(source=prompts, limit=12, validation=3)
    r["sampling"]["max_new_tokens"] = 12
    r["limits"] = {"max_prompt_tokens": 200, "max_seq_len": 256}
    r["aux_layer_ids"] = _aux_rule(TINY_LAYERS)
    r["capture"].update(backend="transformers", batch_size=4, prompts_per_shard=4)
    r["extract"].update(backend="transformers", shard_bytes=60_000, batch_tokens=256)
    for key in ("hidden_size", "num_key_value_heads"):  # derived from the tiny verifier, as from Qwen3-8B
        del r["draft"][key]
    r["draft"]["draft_vocab_size"] = 128
    r["train"].update(epochs=1, total_seq_len=256)
    r["evaluate"].update(backend="transformers", max_new_tokens=10, num_prompts=2, position_bucket_tokens=8,
                         long_output={"num_prompts": 1, "max_new_tokens": 24})
    r["store"]["uri"] = store
    return r


@pytest.mark.e2e
def test_the_recipe_runs_end_to_end_on_a_tiny_qwen3(tiny_qwen3, tmp_path):
    from eagle_jobs.committed import read_rows
    from eagle_jobs.store import Store

    store = f"file://{tmp_path}/store"
    prompts = f"{store}/prompts/qwen3-8b-prompts.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "eagle_jobs.cli", *args], capture_output=True, text=True,
                              timeout=600, env=env, cwd=tmp_path)

    # the prompt file as the recipe's header builds it, from a local set here (no hub, no bucket)
    write_prompts(tmp_path / "chats.jsonl", n=16)
    r = cli("prompts", "build", "--size", "14", "--source", f"{tmp_path / 'chats.jsonl'}=1", "--out", prompts)
    assert r.returncode == 0 and "14 conversations" in r.stdout, r.stderr[-2000:]
    recipe = tmp_path / "qwen3-tiny.yaml"
    recipe.write_text(yaml.safe_dump(_tiny_recipe(tiny_qwen3, store, prompts), sort_keys=False))
    r = cli("run", "--recipe", str(recipe))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

    st = Store.open(store)
    rows = read_rows(st, "qwen3-8b")
    assert rows and all(row["reasoning"] is not None for row in rows)  # parsed as thinking (chat.reasoning_parser)
    manifest = json.loads(next((tmp_path / "store/qwen3-8b/capture/manifests").glob("*.json")).read_text())
    assert {k: manifest["sampling"][k] for k in ("temperature", "top_p", "top_k")} == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    final = tmp_path / "store/qwen3-8b/train/data/final"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    layer = cfg["transformer_layer_config"]
    # a llama draft, its shape derived from the verifier: its heads, its KV heads (not one per head), its MLP
    assert layer["model_type"] == "llama" and (layer["hidden_size"], layer["num_attention_heads"]) == (64, 4)
    assert (layer["num_key_value_heads"], layer["head_dim"], layer["intermediate_size"]) == (2, 16, 128)
    assert layer["rope_parameters"]["rope_theta"] == 1000000.0  # the verifier's positions, not a default
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    train_cfg = json.loads((final / "train_config.json").read_text())
    assert (train_cfg["optimizer"], train_cfg["lr"]) == ("muon", 1e-3)
    report = json.loads((tmp_path / "store/qwen3-8b/eval/data/report.json").read_text())
    assert set(report["prompt_sets"]) == {"validation", "humaneval", "long-output"}
    assert report["num_speculative_tokens"] == 3 and report["acceptance_length"] >= 1.0
