"""`eagle-jobs compare`: variants of draft/train on one committed extraction, one table, reruns skip."""

import json
import subprocess
import sys

import pytest
import yaml

from eagle_jobs.capture import run_capture
from eagle_jobs.compare import run_compare
from eagle_jobs.errors import BadInput, NotReady
from eagle_jobs.extract import run_extract
from eagle_jobs.recipe import Recipe
from eagle_jobs.recipe_file import load_recipe
from eagle_jobs.store import Stage, Store


def _with_variants(recipe: Recipe, variants: dict) -> Recipe:
    data = recipe.model_dump(mode="json")
    data["variants"] = variants
    return Recipe.model_validate(data)


def test_variants_train_on_one_extraction_and_a_rerun_skips_them(tiny_recipe, bucket, tmp_path, monkeypatch):
    store_uri = f"s3://{bucket}/runs"  # the real S3 API (moto's server); file:// is the same code
    monkeypatch.setenv("EAGLE_JOBS_WORK_DIR", str(tmp_path / "work"))
    recipe = _with_variants(tiny_recipe(train={"epochs": 1}),
                            {"hot": {"train": {"lr": 3e-3}}, "narrow": {"draft": {"draft_vocab_size": 96}}})
    st = Store.open(store_uri)
    st.check()
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    extract_before = {m["shard"]: m["committed_at"] for m in Stage(st, "r", "extract").manifests()}

    # one train replica of the Kubernetes component: trains arm 1 (base is arm 0) and nothing else
    assert run_compare(recipe, st, "r", arm_index=1) == {"run_id": "r", "trained": "hot"}
    assert Stage(st, "r", "variants/hot/train").is_complete()
    assert not Stage(st, "r", "variants/hot/eval").manifests() and not Stage(st, "r", "variants/base/train").manifests()
    hot_trained = Stage(st, "r", "variants/hot/train").manifest("final")["committed_at"]
    with pytest.raises(BadInput, match="--arm-index 3: the recipe has 3 arms"):
        run_compare(recipe, st, "r", arm_index=3)

    report = run_compare(recipe, st, "r")  # trains the other arms, evaluates all, hot is not trained again
    assert Stage(st, "r", "variants/hot/train").manifest("final")["committed_at"] == hot_trained
    assert [r["variant"] for r in report["variants"]] == ["base", "hot", "narrow"] and not report["missing"]
    # what compare stores is its typed record, field for field (eagle_jobs.records; FORMAT.md names each field)
    from eagle_jobs.records import ArmSetResult, CompareArm, CompareReport

    stored = json.loads(st.get("r/compare/data/report.json"))
    assert set(stored) == set(CompareReport.__annotations__)
    assert all(set(a) == set(CompareArm.__annotations__) for a in stored["variants"])
    assert all(set(s) == set(ArmSetResult.__annotations__)
               for a in stored["variants"] for s in a["prompt_sets"].values())
    by = {r["variant"]: r for r in report["variants"]}
    assert by["hot"]["overrides"] == {"train": {"lr": 3e-3}}
    for name, row in by.items():
        (s,) = row["prompt_sets"].values()
        assert s["acceptance_length"] >= 1.0 and row["train_seconds"] > 0
        # each arm trained with its own overrides: the record the arm's train stage committed
        fin = Stage(st, "r", f"variants/{name}/train")
        rec = json.loads(fin.read("final/train_config.json", fin.manifest("final")["files"]["final/train_config.json"]))
        assert rec["lr"] == (3e-3 if name == "hot" else recipe.train.lr)
        cfg = json.loads(fin.read("final/config.json", fin.manifest("final")["files"]["final/config.json"]))
        assert cfg["draft_vocab_size"] == (96 if name == "narrow" else 128)
    # every arm was evaluated on the same prompts
    assert len({r["prompt_sets"]["validation"]["prompts_sha256"] for r in report["variants"]}) == 1
    # no new capture or extraction, and the run's own stages are untouched
    assert {m["shard"]: m["committed_at"] for m in Stage(st, "r", "extract").manifests()} == extract_before
    assert not Stage(st, "r", "train").manifests()
    table = Stage(st, "r", "compare")
    md = table.read("report.md", table.manifest("report")["files"]["report.md"]).decode()
    assert "| hot |" in md and "| narrow |" in md
    assert table.read("compare.png", table.manifest("report")["files"]["compare.png"])[:4] == b"\x89PNG"

    arms_before = {n: Stage(st, "r", f"variants/{n}/eval").manifest("report")["committed_at"] for n in by}
    again = run_compare(recipe, st, "r")  # committed arms are not trained or evaluated again
    assert {n: Stage(st, "r", f"variants/{n}/eval").manifest("report")["committed_at"] for n in by} == arms_before
    assert [r["prompt_sets"] for r in again["variants"]] == [r["prompt_sets"] for r in report["variants"]]
    one = run_compare(recipe, st, "r", only=["narrow"])  # one arm asked for: the table still has all three
    assert [r["variant"] for r in one["variants"]] == ["base", "hot", "narrow"] and not one["missing"]


def test_compare_needs_a_committed_extraction_and_known_variants(tiny_recipe, tmp_path):
    recipe = _with_variants(tiny_recipe(), {"hot": {"train": {"lr": 3e-3}}})
    st = Store.open(f"file://{tmp_path}/s")
    with pytest.raises(NotReady, match="extract of run 'r' is not complete"):
        run_compare(recipe, st, "r")
    with pytest.raises(BadInput, match="no `variants:`"):
        run_compare(tiny_recipe(), st, "r")


@pytest.mark.parametrize("variants,msg", [
    ({"hot": {"train": {"lrr": 1}}}, "variants.hot.train.lrr: Extra inputs are not permitted"),
    ({"hot": {"train": {"lr": -1}}}, "variants.hot.train.lr: Input should be greater than 0"),
    ({"hot": {"capture": {"backend": "vllm"}}}, "variants.hot.capture"),
    ({"Bad/Name": {}}, "'Bad/Name' is not a variant name"),
    ({"base": {}}, "'base' is not a variant name"),
])
def test_a_bad_variant_is_refused_at_load_in_one_line(tiny_recipe, tmp_path, variants, msg):
    raw = tiny_recipe().model_dump(mode="json")
    raw["variants"] = variants
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(BadInput, match=msg.replace(".", r"\.").replace("(", r"\(")):
        load_recipe(path)
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "compare", "--recipe", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_variant_does_not_change_the_runs_own_digests(tiny_recipe):
    recipe = tiny_recipe()
    with_variants = _with_variants(recipe, {"hot": {"train": {"lr": 3e-3}}})
    assert with_variants.digest() == recipe.digest() and with_variants.train_digest() == recipe.train_digest()
    assert with_variants.variant("hot").train_digest() != recipe.train_digest()
