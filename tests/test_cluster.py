"""submit / status / watch / logs through the real kubernetes client against tests/fake_kube.py."""

import threading
import time
from pathlib import Path

import pytest
import yaml

from eagle_jobs import cluster
from eagle_jobs.cluster import WatchExit
from eagle_jobs.errors import BadInput

REPO = Path(__file__).resolve().parents[1]
NS = "eagle-jobs"
JS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
PODS = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture
def kube(tmp_path):
    from fake_kube import FakeKube

    fake = FakeKube()
    url = fake.start()
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
           "clusters": [{"name": "fake", "cluster": {"server": url}}],
           "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "ci", "namespace": NS}}],
           "users": [{"name": "ci", "user": {"token": "t"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    yield fake, str(path)
    fake.stop()


def test_submit_renders_one_run_and_applies_server_side(kube):
    fake, kc = kube
    out = cluster.submit(REPO / "k8s/overlays/full", "ci-42", kubeconfig=kc)
    assert out["jobset"] == "eagle-jobs-ci-42"
    js = fake.get(JS, "eagle-jobs-ci-42")
    assert js["metadata"]["labels"]["eagle-jobs/run-id"] == "ci-42"
    assert js["metadata"]["managedFields"][0] == {**js["metadata"]["managedFields"][0], "manager": "eagle-jobs",
                                                   "operation": "Apply"}
    run_cm = fake.get(f"/api/v1/namespaces/{NS}/configmaps", "eagle-jobs-run-ci-42")
    assert run_cm["data"]["EAGLE_JOBS_RUN_ID"] == "ci-42"
    assert fake.get(f"/api/v1/namespaces/{NS}/configmaps", "eagle-jobs-recipe-ci-42") is not None
    pod = js["spec"]["replicatedJobs"][2]["template"]["spec"]["template"]["spec"]
    assert {"configMapRef": {"name": "eagle-jobs-run-ci-42"}} in pod["containers"][0]["envFrom"]
    assert next(v for v in pod["volumes"] if v["name"] == "recipe")["configMap"]["name"] == "eagle-jobs-recipe-ci-42"
    assert all(m == "PATCH" for m, p in fake.requests if "jobsets" in p and "watch" not in p)
    rv = js["metadata"]["resourceVersion"]
    cluster.submit(REPO / "k8s/overlays/full", "ci-42", kubeconfig=kc)  # idempotent
    assert fake.get(JS, "eagle-jobs-ci-42")["metadata"]["resourceVersion"] == rv
    # a second run id is a second JobSet beside the first
    cluster.submit(REPO / "k8s/overlays/full", "ci-43", kubeconfig=kc)
    assert fake.get(JS, "eagle-jobs-ci-43") is not None and fake.get(JS, "eagle-jobs-ci-42") is not None


def test_submit_with_recipe_validates_it_first(kube, tmp_path):
    fake, kc = kube
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "jobs/kimi-k2.5.yaml").read_text().replace("epochs:", "epochz:"))
    with pytest.raises(BadInput, match="epochz"):
        cluster.submit(REPO / "k8s/overlays/full", "r1", recipe_path=bad, kubeconfig=kc)
    assert not fake.requests  # nothing applied
    good = tmp_path / "good.yaml"
    good.write_text((REPO / "jobs/kimi-k2.5.yaml").read_text().replace("epochs: 10", "epochs: 2"))
    cluster.submit(REPO / "k8s/overlays/full", "r1", recipe_path=good, kubeconfig=kc)
    cm = fake.get(f"/api/v1/namespaces/{NS}/configmaps", "eagle-jobs-recipe-r1")
    assert "epochs: 2" in cm["data"]["recipe.yaml"]


def test_submit_conflicts_are_one_line(kube):
    fake, kc = kube
    cluster.submit(REPO / "k8s/overlays/smoke", "c1", kubeconfig=kc)
    # the same run id with another spec: JobSet's replicatedJobs are immutable (422)
    with pytest.raises(BadInput, match="different spec"):
        cluster.submit(REPO / "k8s/overlays/full", "c1", kubeconfig=kc)
    # an object someone else manages (409 without force)
    fake.objects[(JS, "eagle-jobs-c2")] = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                                           "metadata": {"name": "eagle-jobs-c2", "namespace": NS, "uid": "u",
                                                        "creationTimestamp": "2026-01-01T00:00:00Z",
                                                        "resourceVersion": "5",
                                                        "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
                                           "spec": {}}
    with pytest.raises(BadInput, match="managed by someone else"):
        cluster.submit(REPO / "k8s/overlays/full", "c2", kubeconfig=kc)


def _job(name, stage, **status):
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{name}-{stage}-0", "namespace": NS,
                         "labels": {"jobset.sigs.k8s.io/jobset-name": name,
                                    "jobset.sigs.k8s.io/replicatedjob-name": stage}},
            "spec": {"template": {"spec": {"containers": [{"name": "worker", "image": "x"}]}}},
            "status": status}


def _pod(name, stage, i=0, exit_code=None):
    st = {"phase": "Failed" if exit_code else "Running", "containerStatuses": [{
        "name": "worker", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}} if exit_code else {"running": {}}}]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{stage}-0-{i}-abcde", "namespace": NS,
                         "labels": {"jobset.sigs.k8s.io/jobset-name": name,
                                    "jobset.sigs.k8s.io/replicatedjob-name": stage}},
            "spec": {"containers": [{"name": "worker", "image": "x"}]}, "status": st}


def _cond(type_, reason=None):
    return {"type": type_, "status": "True", "reason": reason or type_, "message": f"{type_} happened",
            "lastTransitionTime": "2026-12-01T00:00:00Z", "lastProbeTime": "2026-12-01T00:00:00Z"}


def test_status_and_logs(kube, capsys):
    fake, kc = kube
    api = cluster.api_client(kc)
    assert cluster.stage_states(api, NS, "nope")["state"] == "NotFound"  # a 404, not a crash
    cluster.submit(REPO / "k8s/overlays/full", "s1", kubeconfig=kc)
    name = "eagle-jobs-s1"
    fake.put(JOBS, _job(name, "capture", succeeded=1, conditions=[_cond("Complete")]))
    fake.put(JOBS, _job(name, "extract", active=2, succeeded=1, completedIndexes="1", failedIndexes="3"))
    s = cluster.stage_states(api, NS, "s1")
    assert s["state"] == "Running"
    assert s["stages"]["capture"]["state"] == "Complete" and s["stages"]["train"]["state"] == "Waiting"
    assert (s["stages"]["extract"]["completed_indexes"], s["stages"]["extract"]["failed_indexes"]) == ("1", "3")
    fake.put(PODS, _pod(name, "extract"))
    fake.logs[(NS, f"{name}-extract-0-0-abcde")] = "extract worker 0/4: 10 rows\n"
    assert "extract worker 0/4" in cluster.logs(api, NS, "s1", stage="extract")


def _progress(fake, name, steps):
    def run():
        for delay, fn in steps:
            time.sleep(delay)
            fn()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_watch_to_success_through_dropped_watch_and_410(kube):
    fake, kc = kube
    api = cluster.api_client(kc)
    cluster.submit(REPO / "k8s/overlays/smoke", "w1", kubeconfig=kc)
    name = "eagle-jobs-w1"

    def finish():
        for st in cluster.STAGES:
            fake.put(JOBS, _job(name, st, succeeded=1, conditions=[_cond("Complete")]))
        fake.set_status(JS, name, {"conditions": [_cond("Completed", "AllJobsCompleted")]})

    fake.drop_next_watch = True
    t = _progress(fake, name, [
        (0.5, lambda: fake.put(JOBS, _job(name, "capture", active=1))),
        (0.5, fake.compact),  # the watcher's resourceVersion is now too old: 410 Gone
        (0.3, lambda: fake.set_status(JS, name, {"conditions": []})),
        (0.5, finish),
    ])
    code = cluster.watch(api, NS, "w1", timeout_s=30)
    t.join()
    assert code == WatchExit.SUCCEEDED
    watches = [p for m, p in fake.requests if p.endswith("?watch")]
    assert len(watches) >= 3  # reconnected after the drop and re-listed after 410


@pytest.mark.parametrize("exit_code,reason,expected", [
    (3, "PodFailurePolicy", WatchExit.BAD_INPUT),
    (4, "PodFailurePolicy", WatchExit.STORE),
    (1, "BackoffLimitExceeded", WatchExit.FAILED),
    (None, "DeadlineExceeded", WatchExit.DEADLINE),
])
def test_watch_failure_kinds(kube, exit_code, reason, expected):
    fake, kc = kube
    api = cluster.api_client(kc)
    cluster.submit(REPO / "k8s/overlays/smoke", "f1", kubeconfig=kc)
    name = "eagle-jobs-f1"

    def fail():
        fake.put(PODS, _pod(name, "extract", exit_code=exit_code))
        fake.put(JOBS, _job(name, "extract", failed=1, conditions=[_cond("Failed", reason)]))
        fake.set_status(JS, name, {"conditions": [_cond("Failed", "FailedJobs")]})

    t = _progress(fake, name, [(0.4, fail)])
    assert cluster.watch(api, NS, "f1", timeout_s=30) == expected
    t.join()


def test_watch_gone_and_timeout(kube):
    fake, kc = kube
    api = cluster.api_client(kc)
    assert cluster.watch(api, NS, "absent", timeout_s=5) == WatchExit.GONE
    cluster.submit(REPO / "k8s/overlays/smoke", "g1", kubeconfig=kc)
    t0 = time.monotonic()
    assert cluster.watch(api, NS, "g1", timeout_s=1.5) == WatchExit.TIMEOUT
    assert time.monotonic() - t0 < 10
    t = _progress(fake, "eagle-jobs-g1", [(0.4, lambda: fake.delete(JS, "eagle-jobs-g1"))])
    assert cluster.watch(api, NS, "g1", timeout_s=30) == WatchExit.GONE
    t.join()


def test_cli_watch_exit_code(kube, tmp_path):
    import os
    import subprocess
    import sys

    fake, kc = kube
    cluster.submit(REPO / "k8s/overlays/smoke", "x1", kubeconfig=kc)
    fake.set_status(JS, "eagle-jobs-x1", {"conditions": [_cond("Completed", "AllJobsCompleted")]})
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "watch", "x1", "--kubeconfig", kc, "--timeout", "20"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    fake.set_status(JS, "eagle-jobs-x1", {"conditions": [_cond("Failed", "FailedJobs")]})
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "watch", "x1", "--kubeconfig", kc, "--timeout", "20"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == int(WatchExit.FAILED), r.stderr
