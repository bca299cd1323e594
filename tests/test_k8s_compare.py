"""k8s/components/compare: the recipe's arms as the train job's indexes, the table from evaluate."""

import re

import jobset_admission
from k8s_helpers import _job, _jobset, _pod, _render_overlay

ARGS_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) in args from the container's env, as the kubelet does (kubernetes
    third_party/forked/golang/expansion/expand.go: a reference to an undefined variable stays as is)."""
    return [ARGS_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def test_variants_train_as_indexes_and_evaluate_writes_the_table(tmp_path):
    docs = _render_overlay(tmp_path, {"resources": ["base"], "components": ["components/compare"]})
    js = _jobset(docs)
    for version in jobset_admission.VERSIONS:  # admitted by the oldest and newest supported JobSet
        assert jobset_admission.schema_errors(js, version, strict=True) == []
        assert jobset_admission.webhook_errors(js, version) == []
    train = _job(js, "train")
    assert train["completionMode"] == "Indexed" and train["completions"] == train["parallelism"] == 2
    worker = _pod(js, "train")["containers"][0]
    # the Job controller gives every container of an Indexed Job JOB_COMPLETION_INDEX
    # (kubernetes pkg/controller/job/indexed_job_utils.go, addCompletionIndexEnvVariable)
    assert not any(e["name"] == "JOB_COMPLETION_INDEX" for e in worker.get("env", []))
    for index in range(train["completions"]):
        args = expand(worker["args"], {"JOB_COMPLETION_INDEX": str(index)})
        assert args == ["compare", "--recipe", "/etc/eagle-jobs/recipe.yaml", "--arm-index", str(index)]
    assert _pod(js, "evaluate")["containers"][0]["args"] == ["compare", "--recipe", "/etc/eagle-jobs/recipe.yaml"]
    # the arms run where the run's own stages did: the same image and service account
    (tmp_path / "b").mkdir()
    base = _jobset(_render_overlay(tmp_path / "b", {"resources": ["base"]}))
    assert worker["image"] == _pod(base, "train")["containers"][0]["image"]
    assert _pod(js, "train")["serviceAccountName"] == _pod(base, "train")["serviceAccountName"]


def test_the_component_refuses_a_pipeline_whose_indexes_moved(tmp_path):
    """Listed after verifier-mirror (which inserts a stage at 0) its patches would hit the wrong jobs:
    kustomize's JSON-patch `test` op stops the render instead."""
    import pytest

    with pytest.raises(AssertionError, match="testing value /spec/replicatedJobs/2/name failed|test operation"):
        _render_overlay(tmp_path, {"resources": ["base"], "components": ["components/verifier-mirror",
                                                                       "components/compare"]})
