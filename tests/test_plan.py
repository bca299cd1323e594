from pathlib import Path

from eagle_jobs.plan import make_plan
from eagle_jobs.recipe import load_recipe

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


def test_plan_scales_with_gpus_and_storage():
    r = load_recipe(REPO / "jobs/kimi-k2.5.yaml")
    one = r.model_copy(update={"train": r.train.model_copy(update={"nproc_per_node": 1})})
    assert abs(make_plan(one)["stages"]["train"]["time_s"] / make_plan(r)["stages"]["train"]["time_s"] - 8) < 1e-6
    fp8 = r.model_copy(update={"extract": r.extract.model_copy(update={"storage_dtype": "fp8"})})
    assert make_plan(fp8)["stages"]["extract"]["write_bytes"] < 0.51 * make_plan(r)["stages"]["extract"]["write_bytes"]
    assert make_plan(r)["stages"]["extract"]["objects"] > 100


def test_cli_plan_runs(capsys):
    from eagle_jobs.plan import print_plan

    print_plan(load_recipe(REPO / "jobs/demo.yaml"))
