"""k8s/components/stream: training starts when every extraction pod is Ready, not when extraction is Complete.

`job_ready` and `dependency_reached` are stand-ins for JobSet's controller, ported from kubernetes-sigs/jobset
v0.12.0: pkg/controllers/jobset_controller.go (the jobsReady loop: a Job counts Ready once its ready +
succeeded pods reach min(parallelism, completions)) and pkg/controllers/depends_on.go
(dependencyReachedStatus: Ready once Ready + Succeeded + Failed Jobs equal the replicas; Complete once
Succeeded does). v0.8.2's depends_on.go makes the same test on dependsOn[0], the only entry ours have.
"""

import jobset_admission
import pytest
from k8s_helpers import _job, _jobset, _render_overlay


def job_ready(job: dict, ready_pods: int, succeeded_pods: int) -> bool:
    spec = job
    pods = min(spec["parallelism"], spec.get("completions", spec["parallelism"]))
    return succeeded_pods + ready_pods >= pods


def dependency_reached(rjob: dict, replicas: dict[str, int], statuses: dict[str, dict]) -> bool:
    for dep in rjob.get("dependsOn") or []:
        s = statuses.get(dep["name"])
        if s is None:
            return False
        if dep["status"] == "Complete" and replicas[dep["name"]] != s["succeeded"]:
            return False
        if dep["status"] == "Ready" and replicas[dep["name"]] != s["failed"] + s["ready"] + s["succeeded"]:
            return False
    return True


def _rjob(js: dict, name: str) -> dict:
    return next(r for r in js["spec"]["replicatedJobs"] if r["name"] == name)


@pytest.mark.parametrize("with_stream", [False, True])
def test_train_starts_when_every_extraction_pod_is_ready_only_with_the_component(tmp_path, with_stream):
    docs = _render_overlay(tmp_path, {"resources": ["base"],
                                      "components": ["components/stream"] if with_stream else []})
    js = _jobset(docs)
    for version in jobset_admission.VERSIONS:  # admitted by the oldest and newest supported JobSet
        assert jobset_admission.schema_errors(js, version, strict=True) == []
        assert jobset_admission.webhook_errors(js, version) == []
    train = _rjob(js, "train")
    assert train["dependsOn"] == [{"name": "extract", "status": "Ready" if with_stream else "Complete"}]
    extract = {**_job(js, "extract"), "completions": 4, "parallelism": 4}  # the full overlay's four workers
    replicas = {"extract": _rjob(js, "extract").get("replicas", 1)}

    def starts(ready_pods: int, succeeded_pods: int) -> bool:
        ready = job_ready(extract, ready_pods, succeeded_pods)
        done = succeeded_pods == extract["completions"]
        return dependency_reached(train, replicas, {"extract": {"ready": int(ready and not done), "failed": 0,
                                                                "succeeded": int(done)}})

    assert not starts(3, 0)  # one extraction server still loading the verifier
    assert starts(4, 0) == with_stream  # all four serving: streaming starts training now
    assert starts(0, 4)  # extraction done: both start training


def test_the_stream_component_refuses_a_pipeline_whose_indexes_moved(tmp_path):
    with pytest.raises(AssertionError, match="testing value /spec/replicatedJobs/2/name failed|test operation"):
        _render_overlay(tmp_path, {"resources": ["base"], "components": ["components/verifier-mirror",
                                                                       "components/stream"]})
