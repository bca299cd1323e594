"""submit / status / watch / logs through the real kubernetes client against tests/fake_kube.py."""

import json
import re
import threading
import time
from pathlib import Path

import pytest
from conftest import COLLECTIONS, JOBS, JS, NS, PODS

from eagle_jobs import cluster
from eagle_jobs.cluster import WatchExit
from eagle_jobs.errors import BadInput, Busy
from eagle_jobs.layout import STAGES

REPO = Path(__file__).resolve().parents[1]
def _configmap(fake, prefix):
    (cm,) = [o for (c, n), o in fake.objects.items() if c.endswith("/configmaps") and n.startswith(prefix)]
    return cm


def test_submit_renders_one_run_and_applies_server_side(kube):
    fake, kc = kube
    out = cluster.submit(REPO / "k8s/overlays/full", "ci-42", kubeconfig=kc)
    assert out["jobset"] == "eagle-jobs-ci-42"
    js = fake.get(JS, "eagle-jobs-ci-42")
    assert js["metadata"]["labels"]["eagle-jobs/run-id"] == "ci-42"
    assert js["metadata"]["managedFields"][0] == {**js["metadata"]["managedFields"][0], "manager": "eagle-jobs",
                                                   "operation": "Apply"}
    run_cm = _configmap(fake, "eagle-jobs-run-ci-42-")
    assert run_cm["data"]["EAGLE_JOBS_RUN_ID"] == "ci-42"
    recipe_cm = _configmap(fake, "eagle-jobs-recipe-ci-42-")
    assert recipe_cm["metadata"]["name"] == f"eagle-jobs-recipe-ci-42-{cluster.name_suffix(recipe_cm['data'])}"
    pod = js["spec"]["replicatedJobs"][2]["template"]["spec"]["template"]["spec"]
    assert {"configMapRef": {"name": run_cm["metadata"]["name"]}} in pod["containers"][0]["envFrom"]
    assert (next(v for v in pod["volumes"] if v["name"] == "recipe")["configMap"]["name"]
            == recipe_cm["metadata"]["name"])
    # server-side apply (PATCH), never a create or replace; the GET reads the new JobSet's uid for its ConfigMaps
    assert {m for m, p in fake.requests if "jobsets" in p and "watch" not in p} == {"PATCH", "GET"}
    rv = js["metadata"]["resourceVersion"]
    cluster.submit(REPO / "k8s/overlays/full", "ci-42", kubeconfig=kc)  # idempotent
    assert fake.get(JS, "eagle-jobs-ci-42")["metadata"]["resourceVersion"] == rv
    # one run of a recipe at a time: a second run id of the same recipe is refused, nothing applied, while the
    # first has neither a Completed nor a Failed condition; then it is a second JobSet beside the first
    assert js["metadata"]["labels"]["eagle-jobs/recipe"] == "kimi-k2.5"
    fake.requests.clear()
    with pytest.raises(Busy, match=r"run ci-42 of recipe 'kimi-k2.5' is still running \(JobSet eagle-jobs-ci-42"):
        cluster.submit(REPO / "k8s/overlays/full", "ci-43", kubeconfig=kc)
    assert not [m for m, _p in fake.requests if m == "PATCH"] and fake.get(JS, "eagle-jobs-ci-43") is None
    fake.set_status(JS, "eagle-jobs-ci-42", {"conditions": [{"type": "Failed", "status": "True"}]})
    cluster.submit(REPO / "k8s/overlays/full", "ci-43", kubeconfig=kc)
    assert fake.get(JS, "eagle-jobs-ci-43") is not None and fake.get(JS, "eagle-jobs-ci-42") is not None
    cluster.submit(REPO / "k8s/overlays/smoke", "smoke-1", kubeconfig=kc)  # another recipe: beside them


def test_submit_with_recipe_validates_it_first(kube, tmp_path):
    fake, kc = kube
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "jobs/kimi-k2.5.yaml").read_text().replace("  lr: 1.0e-4\n", "  lrr: 1.0e-4\n"))
    with pytest.raises(BadInput, match="lrr"):
        cluster.submit(REPO / "k8s/overlays/full", "r1", recipe_path=bad, kubeconfig=kc)
    assert not fake.requests  # nothing applied
    good = tmp_path / "good.yaml"
    good.write_text((REPO / "jobs/kimi-k2.5.yaml").read_text().replace("  lr: 1.0e-4\n", "  lr: 2.0e-4\n"))
    cluster.submit(REPO / "k8s/overlays/full", "r1", recipe_path=good, kubeconfig=kc)
    assert "lr: 2.0e-4" in _configmap(fake, "eagle-jobs-recipe-r1-")["data"]["recipe.yaml"]


def test_submit_conflicts_are_one_line(kube):
    fake, kc = kube
    cluster.submit(REPO / "k8s/overlays/smoke", "c1", kubeconfig=kc)
    # the same run id with another spec: JobSet's replicatedJobs are immutable (422)
    with pytest.raises(BadInput,
                       match=r"refused JobSet/eagle-jobs-c1 \(422\): .*spec.replicatedJobs: .*field is immutable"):
        cluster.submit(REPO / "k8s/overlays/full", "c1", kubeconfig=kc)
    # an object someone else manages (409 without force)
    fake.objects[(JS, "eagle-jobs-c2")] = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "eagle-jobs-c2", "namespace": NS, "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z",
                     "resourceVersion": "5", "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
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
        for st in STAGES:
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


def _waiting_pod(name, stage, i, *, phase="Pending", scheduled=True, init=(), containers=(), node=True):
    """A pod as the kubelet reports it while it waits; init/containers: (name, state dict, extra status)."""
    def statuses(items):
        return [{"name": n, "image": "x", "imageID": "", "ready": False, "restartCount": rc, "started": started,
                 "state": state} for n, state, rc, started in items]
    st = {"phase": phase, "conditions": [] if scheduled else [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
    if init:
        st["initContainerStatuses"] = statuses(init)
    if containers:
        st["containerStatuses"] = statuses(containers)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{stage}-0-{i}-abcde", "namespace": NS,
                         "labels": {"jobset.sigs.k8s.io/jobset-name": name,
                                    "jobset.sigs.k8s.io/replicatedjob-name": stage}},
            "spec": {**({"nodeName": "gpu-1"} if node else {}),
                     "initContainers": [{"name": "prepare", "image": "x"},
                                        {"name": "vllm", "image": "x", "restartPolicy": "Always"}],
                     "containers": [{"name": "worker", "image": "x"}]},
            "status": st}


WAIT = {"waiting": {"reason": "PodInitializing"}}
PULL = {"waiting": {"reason": "ImagePullBackOff",
                    "message": 'Back-off pulling image "ghcr.io/eagle-jobs/capture:0.1.0"'}}
LOOP = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container=prepare"}}
DONE = {"terminated": {"exitCode": 0, "reason": "Completed"}}


def _loading_since(minutes):
    t = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - minutes * 60))
    return {"running": {"startedAt": t}}


def _four_waiting_pods(fake, name):
    """Pods the Job counts as 'active' alike: unschedulable, image pull, init crash loop, a model load."""
    fake.put(PODS, _waiting_pod(name, "extract", 0, scheduled=False, node=False))
    fake.put(PODS, _waiting_pod(name, "extract", 1, init=[("prepare", PULL, 0, False)],
                                containers=[("worker", WAIT, 0, False)]))
    fake.put(PODS, _waiting_pod(name, "extract", 2, init=[("prepare", LOOP, 4, False)],
                                containers=[("worker", WAIT, 0, False)]))
    fake.put(PODS, _waiting_pod(name, "extract", 3,
                                init=[("prepare", DONE, 0, False), ("vllm", _loading_since(90), 0, False)],
                                containers=[("worker", WAIT, 0, False)]))
    fake.put(JOBS, _job(name, "extract", active=4))


def test_status_says_why_each_pod_waits(kube, capsys):
    """A Job counts pending pods as active: the Job level calls all four 'Running'. Per pod, they differ."""
    fake, kc = kube
    api = cluster.api_client(kc)
    cluster.submit(REPO / "k8s/overlays/full", "p1", kubeconfig=kc)
    _four_waiting_pods(fake, "eagle-jobs-p1")
    s = cluster.stage_states(api, NS, "p1")
    assert s["stages"]["extract"]["state"] == "Running"  # what a Job-level view says of all four
    whys = [(p["phase"], p["why"]) for p in s["stages"]["extract"]["pods"]]
    assert whys[0] == ("Pending", "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert whys[1][1].startswith("Init:ImagePullBackOff (prepare: Back-off pulling image")
    assert whys[2][1].startswith("Init:CrashLoopBackOff (prepare") and "4 restarts" in whys[2][1]
    assert re.match(r"Init:vllm starting for 1h(29|30)m \(not ready yet: loading the model\)", whys[3][1]), whys[3]
    capsys.readouterr()
    cluster.print_status(s, None)
    out = capsys.readouterr().err
    assert "ImagePullBackOff" in out and "Unschedulable" in out and "CrashLoopBackOff" in out


def test_watch_prints_pod_changes_and_a_heartbeat_between_them(kube, capsys):
    fake, kc = kube
    api = cluster.api_client(kc)
    cluster.submit(REPO / "k8s/overlays/smoke", "h1", kubeconfig=kc)
    name = "eagle-jobs-h1"
    fake.put(PODS, _waiting_pod(name, "capture", 0,
                                init=[("prepare", DONE, 0, False), ("vllm", _loading_since(3), 0, False)],
                                containers=[("worker", WAIT, 0, False)]))
    fake.put(JOBS, _job(name, "capture", active=1))

    def ready():  # the model loaded: the pod's worker runs; no JobSet event comes with it
        fake.put(PODS, _pod(name, "capture"))

    t = _progress(fake, name, [(1.6, ready)])
    assert cluster.watch(api, NS, "h1", timeout_s=4.5, heartbeat_s=1.0) == WatchExit.TIMEOUT
    t.join()
    err = capsys.readouterr().err
    beats = [ln for ln in err.splitlines()
             if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC eagle-jobs-h1 Running: ", ln)]
    assert len(beats) >= 2, err
    assert "capture Running [eagle-jobs-h1-capture-0-0 Pending Init:vllm starting for 3m" in beats[0]
    assert err.count("pods") >= 2  # a second table once the worker runs, though the JobSet did not change
    assert err.rindex("Running") > err.index("Init:vllm starting")


def test_logs_of_a_pod_whose_worker_waits_fall_back_to_vllm_and_events(kube):
    fake, kc = kube
    api = cluster.api_client(kc)
    cluster.submit(REPO / "k8s/overlays/full", "l1", kubeconfig=kc)
    name = "eagle-jobs-l1"
    _four_waiting_pods(fake, name)
    loading = f"{name}-extract-0-3-abcde"
    fake.logs[(NS, loading, "vllm")] = "INFO Loading weights took 3127.41 seconds\n"
    ev = f"/api/v1/namespaces/{NS}/events"
    for pod, reason, msg in [(f"{name}-extract-0-0-abcde", "FailedScheduling", "0/3 nodes are available"),
                             (loading, "Unhealthy", "Startup probe failed: connection refused")]:
        fake.put(ev, {"apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": reason, "message": msg,
                      "count": 3, "involvedObject": {"kind": "Pod", "name": pod, "namespace": NS},
                      "metadata": {"name": f"{pod}.1", "namespace": NS}})
    out = cluster.logs(api, NS, "l1", stage="extract")  # the real API answers 400 for the waiting workers
    assert f"==> {loading} [vllm] <==\nINFO Loading weights" in out
    assert "Unhealthy" in out and "Startup probe failed" in out and "(x3)" in out
    assert f"{name}-extract-0-0-abcde: Pending (Unschedulable" in out and "FailedScheduling" in out
    assert "Init:ImagePullBackOff" in out and "events: none" in out


def test_submit_leaves_shared_objects_to_cluster_setup(kube):
    """An admin applied k8s/cluster-setup with kubectl; a CI submit after it applies only the run's
    ConfigMaps and JobSet: no server-side-apply conflict over the ServiceAccount, nothing relabelled."""
    fake, kc = kube
    sa_before = json.loads(json.dumps(fake.get(COLLECTIONS["ServiceAccount"], "eagle-jobs-worker")))
    pol_before = json.loads(json.dumps(fake.get(COLLECTIONS["NetworkPolicy"], "eagle-jobs-vllm-no-ingress")))
    out = cluster.submit(REPO / "k8s/overlays/full", "ci-7", kubeconfig=kc)
    assert {a.split("/")[0] for a in out["applied"]} == {"ConfigMap", "JobSet"}
    patched = {p.split("/")[-2] for m, p in fake.requests if m == "PATCH"}
    assert patched == {"configmaps", "jobsets"}
    assert fake.get(COLLECTIONS["ServiceAccount"], "eagle-jobs-worker") == sa_before
    assert fake.get(COLLECTIONS["NetworkPolicy"], "eagle-jobs-vllm-no-ingress") == pol_before
    cluster.submit(REPO / "k8s/overlays/smoke", "ci-8", kubeconfig=kc)  # a second run: still nothing shared touched
    assert fake.get(COLLECTIONS["NetworkPolicy"], "eagle-jobs-vllm-no-ingress") == pol_before


def test_submit_without_cluster_setup_says_so_and_applies_nothing(kube):
    fake, kc = kube
    fake.delete(COLLECTIONS["ServiceAccount"], "eagle-jobs-worker")
    fake.requests.clear()
    with pytest.raises(BadInput, match="kubectl apply -k k8s/cluster-setup"):
        cluster.submit(REPO / "k8s/overlays/full", "ci-9", kubeconfig=kc)
    assert not [r for r in fake.requests if r[0] == "PATCH"]


def test_submit_pins_the_images_ci_built_and_records_them_for_lineage(kube):
    fake, kc = kube
    digest = {n: f"ghcr.io/acme/eagle-jobs-{n}@sha256:{c * 64}"
              for n, c in (("capture", "a"), ("extract", "b"), ("train", "c"))}
    with pytest.raises(BadInput, match="by digest"):
        cluster.submit(REPO / "k8s/overlays/full", "d1", kubeconfig=kc, images={"train": "ghcr.io/acme/train:latest"})
    assert not [r for r in fake.requests if r[0] == "PATCH"]
    cluster.submit(REPO / "k8s/overlays/full", "d1", kubeconfig=kc, images=digest)
    js = fake.get(JS, "eagle-jobs-d1")
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["image"] in digest.values(), (rj["name"], c["name"], c["image"])
    assert _pod_image(js, "evaluate") == digest["capture"] and _pod_image(js, "mirror") == digest["train"]
    run_cm = _configmap(fake, "eagle-jobs-run-d1-")
    assert json.loads(run_cm["data"]["EAGLE_JOBS_IMAGE_DIGESTS"]) == digest


def _pod_image(js, stage):
    rj = next(r for r in js["spec"]["replicatedJobs"] if r["name"] == stage)
    return rj["template"]["spec"]["template"]["spec"]["containers"][0]["image"]


@pytest.mark.parametrize("name", ["kimi-k2.5", "Kimi K2.5 / thinking (v2)", "-" * 3 + "x" * 80 + "_", "%%%"])
def test_the_recipe_label_is_a_label_value_the_api_server_accepts(name):
    """apimachinery v0.33.0 pkg/util/validation/validation.go:154-165 (IsValidLabelValue): empty, or at most
    63 characters of [-A-Za-z0-9_.] that begin and end alphanumeric; a name with nothing usable gets no label."""
    from eagle_jobs.cluster.render import recipe_label

    value = recipe_label(f"name: {json.dumps(name)}\n")
    if value is None:
        assert not re.sub(r"[^A-Za-z0-9]", "", name)
        return
    assert len(value) <= 63 and re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", value), value
