import json
import re
from pathlib import Path

import pytest
from conftest import draft_and_batch

from eagle_jobs.plan import make_plan
from eagle_jobs.recipe_file import load_recipe

REPO = Path(__file__).resolve().parents[1]


def test_kimi_smoke_plan_from_the_recipe_alone():
    r = load_recipe(REPO / "jobs/kimi-k2.5-smoke.yaml")
    p = make_plan(r)  # no hub access: shape from the recipe, prompts from the bundled set
    assert p["conversations"] == 10 and p["stored_layers"] == 4
    assert p["hidden_state_bytes"]["bfloat16"] == p["tokens"] * (4 * 7168 * 2 + 9)
    assert 0.49 < p["hidden_state_bytes"]["fp8"] / p["hidden_state_bytes"]["bfloat16"] < 0.51
    # the seed's measured point: 10 samples x 3 epochs in about a minute on one GPU
    assert 50 <= p["stages"]["train"]["time_s"] <= 70
    assert p["draft_parameters"]["trainable"] > 0.9e9 and p["draft_parameters"]["total"] > 2.3e9


def _with(r, **sections):
    return r.model_copy(update={k: getattr(r, k).model_copy(update=v) for k, v in sections.items()})


def test_plan_scales_with_gpus_and_storage():
    """Training's epoch is its compute or its store reads, whichever is slower, and streamed training starts
    once each extraction pod has committed a shard: the one time model (plan_time), which `plan --scale`
    prices with too."""
    kimi = load_recipe(REPO / "jobs/kimi-k2.5.yaml")
    fp8 = _with(kimi, train={"source": "stored"}, extract={"storage_dtype": "fp8"})
    one = _with(fp8, train={"nproc_per_node": 1})
    stored = make_plan(fp8)
    # compute-bound: eight GPUs train eight times as fast
    assert abs(make_plan(one)["stages"]["train"]["time_s"] / stored["stages"]["train"]["time_s"] - 8) < 1e-6
    # bf16 doubles the corpus; too large to stage on local disk, every epoch reads it from the store, which is
    # then slower than the compute
    bf16 = make_plan(_with(fp8, extract={"storage_dtype": "bfloat16"}))
    corpus = bf16["hidden_state_bytes"]["bfloat16"]
    assert corpus > kimi.train.local_stage_bytes
    reads_s = kimi.train.epochs * corpus / (kimi.plan.store_bytes_per_s * kimi.train.nnodes)
    assert bf16["stages"]["train"]["time_s"] == pytest.approx(reads_s) and reads_s > stored["stages"]["train"]["time_s"]
    assert bf16["stages"]["train"]["read_bytes"] == kimi.train.epochs * corpus
    assert stored["stages"]["extract"]["write_bytes"] < 0.51 * bf16["stages"]["extract"]["write_bytes"]
    assert bf16["stages"]["extract"]["objects"] > 100
    # the recipe as written: fp8 (auto, far above 64 GiB); streamed training starts after the lead (a shard
    # from each extraction pod) and cannot end its first epoch before extraction's pass
    p = make_plan(kimi)
    assert p["storage"] == "fp8" and p["stages"]["extract"]["write_bytes"] == stored["stages"]["extract"]["write_bytes"]
    epoch, x = stored["stages"]["train"]["time_s"] / kimi.train.epochs, p["stages"]["extract"]["time_s"]
    lead = x * kimi.extract.shard_bytes * kimi.plan.extract_nodes / p["hidden_state_bytes"]["fp8"]
    assert 0 < lead < 60 and p["stages"]["train"]["time_s"] == pytest.approx(max(x, lead + epoch) + 2 * epoch)
    # re-extract: every epoch is a pass, and the extraction pods are booked until the last one ends
    re = make_plan(_with(kimi, train={"later_epochs": "re-extract"}))
    assert re["stages"]["extract"]["time_s"] == re["stages"]["train"]["time_s"] == pytest.approx(
        3 * max(x, lead + epoch))
    assert re["stages"]["extract"]["write_bytes"] == 3 * p["stages"]["extract"]["write_bytes"]


def test_cli_plan_runs(capsys):
    """`eagle-jobs plan` without a store prints the plan it returns, make_plan's: its counts, then a row a
    stage (its time and objects) and the total."""
    from eagle_jobs.plan import duration_text, print_plan

    recipe = load_recipe(REPO / "jobs/demo.yaml")
    p = print_plan(recipe)
    err = capsys.readouterr().err
    assert p == make_plan(recipe)
    assert f"plan {recipe.name}: {p['conversations']:,} conversations, {p['samples']:,} samples, " in err
    cells = [re.split(r"\s*[│┃|]\s*", ln.strip())[1:-1] for ln in err.splitlines()]
    rows = {c[0]: c[1:3] for c in cells if len(c) == 6}  # the table's: name -> [time, objects]
    assert rows == {"stage": ["time", "objects"],
                    **{name: [duration_text(s["time_s"]), f"{s['objects']:,}"] for name, s in p["stages"].items()},
                    "total": [duration_text(p["total_time_s"]), f"{p['total_objects']:,}"]}


@pytest.mark.parametrize("draft", [
    {"num_layers": 1, "norms": {"norm_before_fc": False}},
    {"num_layers": 2, "norms": {"norm_before_fc": True}, "num_key_value_heads": 2},
    {"num_layers": 1, "architecture": "qwen3", "norms": {"norm_before_fc": False, "fc_norm": True}},
])
def test_plan_counts_the_parameters_of_the_draft_speculators_builds(tiny_recipe, draft):
    from eagle_jobs.draft import resolve_shape
    from eagle_jobs.plan import draft_parameters
    from eagle_jobs.verifier import load_config, text_config

    r = tiny_recipe(draft=draft)
    (model,), _, _ = draft_and_batch(r, "sdpa")
    counted = draft_parameters(resolve_shape(r, text_config(load_config(r.verifier))), len(r.aux_layer_ids), r.draft)
    built = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
             "total": sum(p.numel() for p in model.parameters()),
             "saved": sum(v.numel() for k, v in model.state_dict().items()
                          if v.is_floating_point() and k not in model._keys_to_ignore_on_save)}
    assert counted == built


def test_cli_plan_json_is_the_plan():
    from typer.testing import CliRunner

    from eagle_jobs.cli import app

    smoke = REPO / "jobs/kimi-k2.5-smoke.yaml"
    out = CliRunner().invoke(app, ["plan", "--recipe", str(smoke), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == json.loads(json.dumps(make_plan(load_recipe(smoke))))
