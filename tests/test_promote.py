import json

import pytest
from conftest import write_prompts

from eagle_jobs.capture import run_capture
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.evaluate.run import run_evaluate
from eagle_jobs.extract import run_extract
from eagle_jobs.promote import promote
from eagle_jobs.store import Stage, Store
from eagle_jobs.train.run import run_train


def _with_tau(st, run, tau, prompts_sha=None, **set_taus):
    """The same run's report with another tau (on every set, or per set by name): stands in for a
    better or worse retraining."""
    ev = Stage(st, run, "eval")
    m = ev.manifest("report")
    files = {f: ev.read(f, i) for f, i in m["files"].items()}
    rep = json.loads(files["report.json"])
    rep["acceptance_length"] = tau
    for name, x in rep["prompt_sets"].items():
        x["acceptance_length"] = set_taus.get(name, tau)
        if prompts_sha:
            x["prompts_sha256"] = prompts_sha
    if prompts_sha:
        rep["prompts_sha256"] = prompts_sha
    files["report.json"] = json.dumps(rep).encode()
    ev.commit_shard("report", files, {"acceptance_length": tau})


def test_promote_only_when_better_with_lineage(tiny_recipe, tmp_path, bucket):
    # the held-out split and a second set, each reported and compared on its own (HumanEval's prompts
    # are longer than this tiny verifier's limits: a file of short ones stands in for a benchmark set)
    bench = write_prompts(tmp_path / "bench.jsonl", n=4, multi_turn_every=0)
    recipe = tiny_recipe(train={"epochs": 1}, evaluate={"prompt_sets": {"humaneval": str(bench)},
                                                        "num_prompts": 2})
    st = Store.open(f"s3://{bucket}/runs")
    st.check()
    for run in ("a", "b"):
        run_capture(recipe, st, run)
        run_extract(recipe, st, run)
        run_train(recipe, st, run, work_dir=tmp_path / run)
        rep = run_evaluate(recipe, st, run)
    assert list(rep["prompt_sets"]) == ["validation", "humaneval"]  # the held-out split first
    for x in rep["prompt_sets"].values():
        assert x["num_prompts"] == 2 and len(x["per_position_acceptance"]) == 2
        assert x["baseline_acceptance_length"] is not None and len(x["prompts_sha256"]) == 64
    md = st.get("b/eval/data/report.md").decode()
    assert "## τ per prompt set" in md and f"| humaneval | `{bench}` | 2 |" in md
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
    # better on the held-out split but worse on a benchmark set: each set must hold up on its own
    _with_tau(st, "a", 2.5, validation=2.5, humaneval=1.2)
    with pytest.raises(EagleJobsError, match=r"tau\[humaneval\] 1.200 < promoted 'b'") as e:
        promote(st, "a", dest)
    assert e.value.code == ExitCode.NOT_BETTER and d.get_json("CURRENT.json")["run_id"] == "b"
    # other evaluation prompts cannot be compared
    _with_tau(st, "a", 3.0, prompts_sha="0" * 64)
    with pytest.raises(BadInput, match="other prompts"):
        promote(st, "a", dest)
    # the scheduled half of CI: every finished run is decided once, each with its summary
    from eagle_jobs.promote import reconcile

    ev = Stage(st, "b", "eval")
    b_sha = json.loads(ev.read("report.json", ev.manifest("report")["files"]["report.json"]))["prompts_sha256"]
    _with_tau(st, "a", 2.0, prompts_sha=b_sha)  # comparable again
    _with_tau(st, "b", 1.5, prompts_sha=b_sha)
    fresh = f"s3://{bucket}/runs/drafts/reconciled"
    decided = {d["run_id"]: d for d in reconcile(st, fresh)}
    assert set(decided) == {"a", "b"}  # drafts/ is no run: it has no eval stage
    assert decided["a"]["promoted"] and not decided["b"]["promoted"] and "not promoted" in decided["b"]["why"]
    assert Store.open(fresh).get_json("CURRENT.json")["run_id"] == "a"
    assert ("| validation | 2 | 2.000 |" in decided["a"]["summary"]
            and "| humaneval | 2 | 1.500 |" in decided["b"]["summary"])
    assert "b/eval/data/report.md" in decided["b"]["summary"]
    assert reconcile(st, fresh) == []  # decided once: a later pass leaves them alone
    assert reconcile(st, f"s3://{bucket}/runs/drafts/other", prefix="ci-") == []  # only run ids with the prefix


def test_tau_names_its_engine_and_promote_compares_only_under_one(tiny_recipe, tmp_path):
    """Every report names the engine that measured it; a draft promoted on another engine (another vLLM
    version, runner, attention backend, rejection rule or sampling) is not compared with, unless
    --across-engines measures both drafts again here."""
    import transformers

    recipe = tiny_recipe(train={"epochs": 1}, evaluate={"num_prompts": 2})
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "a")
    run_extract(recipe, st, "a")
    run_train(recipe, st, "a", work_dir=tmp_path / "a")
    rep = run_evaluate(recipe, st, "a")
    engine = rep["engine"]
    assert engine["engine"] == "transformers" and transformers.__version__ in engine["version"]
    assert engine["spec_settings"]["num_speculative_tokens"] == 2 and engine["sampling"]["temperature"] == 0.0
    assert engine["sampling"]["max_tokens"] == recipe.evaluate.max_new_tokens and len(engine["key"]) == 16
    assert "## Engine" in st.get("a/eval/data/report.md").decode()
    dest = f"file://{tmp_path}/drafts"
    promote(st, "a", dest)
    d = Store.open(dest)
    cur = d.get_json("CURRENT.json")
    assert cur["engine"] == engine
    # the promoted draft's τ from vLLM 0.31's V1 runner: not comparable with this one's
    other = {**engine, "engine": "vllm", "version": "0.31.0", "model_runner": "V1", "key": "0" * 16}
    d.put_json("CURRENT.json", {**cur, "engine": other})
    with pytest.raises(BadInput, match=r"on vllm 0.31.0, runner V1.*τ from two engines is not compared. "
                                       r"Pass --across-engines"):
        promote(st, "a", dest)
    d.put_json("CURRENT.json", {k: v for k, v in cur.items() if k != "engine"})  # promoted before engines
    with pytest.raises(BadInput, match="an engine it does not name"):
        promote(st, "a", dest)
    nine = {n: {**x, "acceptance_length": 9.0} for n, x in cur["prompt_sets"].items()}
    d.put_json("CURRENT.json", {**cur, "engine": other, "acceptance_length": 9.0, "prompt_sets": nine})
    lin = promote(st, "a", dest, across_engines=True)  # 9.0 was another engine's: both measured again here
    again = lin["remeasured_across_engines"]
    assert again["engine"]["key"] == engine["key"] and again["promoted"]["run_id"] == "a"
    assert again["candidate"]["validation"]["acceptance_length"] == pytest.approx(rep["acceptance_length"])
    assert again["promoted"]["sets"]["validation"] == again["candidate"]["validation"]
    assert d.get_json("CURRENT.json")["engine"]["key"] == engine["key"]
