import subprocess
import sys
from pathlib import Path

import pytest

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe_file import load_recipe

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_load(path):
    r = load_recipe(path)
    assert r.name and r.aux_layer_ids


def test_kimi_smoke_recipe_is_the_seed_run():
    r = load_recipe(REPO / "jobs/kimi-k2.5-smoke.yaml")
    assert (r.prompts.limit, r.prompts.validation) == (10, 2)
    assert (r.train.epochs, r.train.lr, r.train.scheduler) == (3, 3e-5, "cosine")
    assert r.aux_layer_ids == [2, 30, 58]
    d = r.draft
    assert (d.hidden_size, d.num_attention_heads, d.head_dim, d.draft_vocab_size) == (7168, 64, 128, 32000)
    full = load_recipe(REPO / "jobs/kimi-k2.5.yaml")
    assert full.train.nproc_per_node == 8 and full.prompts.limit == 600_000  # the anchors' data (jobs/ comment)
    assert (full.train.source, full.extract.storage_dtype) == ("stream", "auto")


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


BASE = (REPO / "jobs/demo.yaml").read_text()


def test_unknown_key_names_file_and_key(tmp_path):
    p = _write(tmp_path, BASE.replace("  epochs: ", "  epochz: "))
    with pytest.raises(BadInput) as e:
        load_recipe(p)
    assert str(p) in str(e.value) and "train.epochz" in str(e.value)


@pytest.mark.parametrize("old,new,key", [
    ("  epochs: 4\n", "  epochs: 4\n  lr: -1\n", "train.lr"),
    ("name: demo\n", "name: demo\naux_layer_ids: [2, 2]\n", "aux_layer_ids"),
    # vLLM returns aux states in ascending layer order, whatever the list says
    ("name: demo\n", "name: demo\naux_layer_ids: [15, 2, 27]\n", "strictly ascending"),
    # id 0 crashes vLLM's DeepSeek/Kimi aux capture (a None residual)
    ("name: demo\n", "name: demo\naux_layer_ids: [0, 15, 27]\n", ">= 1"),
    ("  concurrency: 128", "  backend: tensorrt\n  concurrency: 128", "capture.backend"),
])
def test_impossible_values_rejected(tmp_path, old, new, key):
    assert old in BASE
    with pytest.raises(BadInput) as e:
        load_recipe(_write(tmp_path, BASE.replace(old, new)))
    assert key in str(e.value)


def test_cli_recipe_typo_exits_bad_input_with_one_line(tmp_path):
    p = _write(tmp_path, BASE.replace("sampling:", "samplin:"))
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "capture", "--recipe", str(p)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "samplin" in lines[0] and str(p) in lines[0]


def test_the_demo_variants_differ_from_the_demo_only_where_they_say():
    """jobs/demo-dev.yaml is jobs/demo.yaml served by the pods' sidecars: only the name, the store, the
    servers' port and host (the sidecar's default port, on the pod IP) and the scratch path may differ."""
    import yaml

    def core(path):
        r = yaml.safe_load((REPO / "jobs" / path).read_text())
        for k in ("name", "description", "store"):
            r.pop(k)
        r["extract"].pop("scratch_dir", None)
        for stage in ("capture", "extract", "evaluate"):
            v = r[stage]["vllm"]
            v.pop("port", None)
            args = v["serve_args"]
            if "--host" in args:
                i = args.index("--host")
                del args[i:i + 2]
        return r

    assert core("demo-dev.yaml") == core("demo.yaml")
    # demo-large: the same run on more conversations (a superset) for more epochs
    large, demo = core("demo-large.yaml"), core("demo.yaml")
    assert large["prompts"].pop("limit") > demo["prompts"].pop("limit")
    assert large["train"].pop("epochs") > demo["train"].pop("epochs")
    assert large == demo


def test_extract_refuses_pipeline_parallelism_in_one_line(tmp_path):
    """vLLM extracts aux-layer hidden states pipeline-parallel only for models that relay them between stages
    (vllm 0.32 v1/worker/gpu/model_runner.py:408-412), which DeepSeek-V3 and Kimi-K2.5 do not: a recipe
    asking for it is refused before any pod loads the verifier; --pipeline-parallel-size 1 is no parallelism."""
    import yaml

    from eagle_jobs.errors import BadInput
    from eagle_jobs.recipe_file import load_recipe

    base = yaml.safe_load((REPO / "jobs/kimi-k2.5.yaml").read_text())
    for args, refused in ((["--pipeline-parallel-size", "2"], True), (["-pp=4"], True),
                          (["--pipeline-parallel-size", "1"], False)):
        recipe = dict(base, extract={**base["extract"], "vllm": {
            **base["extract"]["vllm"], "serve_args": base["extract"]["vllm"]["serve_args"] + args}})
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(recipe))
        if refused:
            with pytest.raises(BadInput) as e:
                load_recipe(path)
            assert "does not run pipeline-parallel" in str(e.value) and "\n" not in str(e.value)
        else:
            assert load_recipe(path).extract.vllm.serve_args[-2:] == args
