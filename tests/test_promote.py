import json

import pytest

from eagle_jobs.capture import run_capture
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.evaluate import run_evaluate
from eagle_jobs.extract import run_extract
from eagle_jobs.promote import promote
from eagle_jobs.store import Stage, Store
from eagle_jobs.train import run_train


def _with_tau(st, run, tau, prompts_sha=None):
    """The same run's report with another tau: stands in for a better or worse retraining."""
    ev = Stage(st, run, "eval")
    m = ev.manifest("report")
    files = {f: ev.read(f, i) for f, i in m["files"].items()}
    rep = json.loads(files["report.json"])
    rep["acceptance_length"] = tau
    if prompts_sha:
        rep["prompts_sha256"] = prompts_sha
    files["report.json"] = json.dumps(rep).encode()
    ev.commit_shard("report", files, {"acceptance_length": tau})


def test_promote_only_when_better_with_lineage(tiny_recipe, tmp_path, bucket):
    recipe = tiny_recipe(train={"epochs": 1})
    st = Store.open(f"s3://{bucket}/runs")
    st.check()
    for run in ("a", "b"):
        run_capture(recipe, st, run)
        run_extract(recipe, st, run)
        run_train(recipe, st, run, work_dir=tmp_path / run)
        run_evaluate(recipe, st, run)
    dest = f"s3://{bucket}/runs/drafts/tiny"
    _with_tau(st, "a", 2.0)
    lin = promote(st, "a", dest)
    d = Store.open(dest)
    cur = d.get_json("CURRENT.json")
    assert cur["run_id"] == "a" and cur["acceptance_length"] == 2.0
    assert {"run_id", "recipe_digest", "verifier", "verifier_revision", "data_manifests_sha256", "git_commit",
            "image_digests", "acceptance_length", "report"} <= set(lin)
    assert set(lin["data_manifests_sha256"]) == {"capture", "extract"} and lin["verifier"] == recipe.verifier.model
    assert d.exists("versions/a/model.safetensors") and d.exists("versions/a/eval/report.md")
    # worse: refused with its own exit code, nothing changes
    _with_tau(st, "b", 1.5)
    with pytest.raises(EagleJobsError) as e:
        promote(st, "b", dest)
    assert e.value.code == ExitCode.NOT_BETTER
    assert d.get_json("CURRENT.json")["run_id"] == "a" and not d.exists("versions/b/model.safetensors")
    # a tie within the tolerance promotes
    _with_tau(st, "b", 1.995)
    assert promote(st, "b", dest, tolerance=0.01)["previous"] == "a"
    assert d.get_json("CURRENT.json")["run_id"] == "b"
    # other evaluation prompts cannot be compared
    _with_tau(st, "a", 3.0, prompts_sha="0" * 64)
    with pytest.raises(BadInput, match="other prompts"):
        promote(st, "a", dest)
