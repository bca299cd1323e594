"""The run's guard (src/eagle_jobs/cluster/guard.py) fails a run whose pods cannot start, within minutes.

The kubelet itself never fails such a pod (kubernetes v1.33: image pulls retry with a backoff capped at
300 s, pkg/kubelet/kubelet.go; a missing Secret is CreateContainerConfigError at every sync,
pkg/kubelet/kubelet_pods.go makeEnvironmentVariables; an exited restartable sidecar is always restarted,
pkg/kubelet/kuberuntime/kuberuntime_container.go computeInitContainerActions), so the pod statuses below are
the ones a stuck pod keeps showing, with the kubelet's own reasons and messages. The guard reads them
through the real kubernetes client from tests/fake_kube.py, on a clock the test moves.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import NS, PODS, kustomize

from eagle_jobs.cluster.api import WatchExit, api_client
from eagle_jobs.cluster.explain import failure_exit
from eagle_jobs.cluster.guard import POLL_S, SIDECAR_EXITS, STUCK_AFTER_S, Stuck, guard
from eagle_jobs.errors import ExitCode

REPO = Path(__file__).resolve().parents[1]
JS_COLL = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
IMAGE = "ghcr.io/eagle-jobs/capture:0.1.0"


@pytest.fixture(scope="module")
def jobset() -> dict:
    (js,) = [d for d in kustomize(REPO / "k8s/overlays/full") if d["kind"] == "JobSet"]
    return js


def _pod(name: str, stage: str, jobset: str, init=(), main=()) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {
                "jobset.sigs.k8s.io/jobset-name": jobset, "jobset.sigs.k8s.io/replicatedjob-name": stage}},
            "spec": {"initContainers": [{"name": "prepare", "image": IMAGE},
                                        {"name": "vllm", "image": IMAGE, "restartPolicy": "Always"}],
                     "containers": [{"name": "worker", "image": IMAGE}]},
            "status": {"phase": "Pending", "initContainerStatuses": list(init), "containerStatuses": list(main)}}


def _waiting(name: str, reason: str, message: str, restarts: int = 0, last: dict | None = None) -> dict:
    return {"name": name, "image": IMAGE, "imageID": "", "ready": False, "restartCount": restarts,
            "state": {"waiting": {"reason": reason, "message": message}},
            **({"lastState": {"terminated": last}} if last else {})}


def _running(name: str) -> dict:
    return {"name": name, "image": IMAGE, "imageID": "", "ready": True, "restartCount": 0,
            "state": {"running": {"startedAt": "2026-12-06T00:00:00Z"}}}


def _play(kube, jobset: dict, script) -> tuple[str | None, float]:
    """Run the guard on the fake API with a clock that each poll moves by POLL_S; script(t, fake) sets the
    pods and JobSet status the kubelet and JobSet controller would show at time t. (the Stuck line or None
    when the guard returned, seconds on its clock)"""
    fake, kc = kube
    js = copy.deepcopy(jobset)
    js.setdefault("status", {})
    fake.put(JS_COLL, js)
    clock = {"t": 0.0}

    def sleep(s: float) -> None:
        clock["t"] += s
        script(clock["t"], fake)

    script(0.0, fake)
    try:
        guard(api_client(kc), NS, js["metadata"]["name"], clock=lambda: clock["t"], sleep=sleep)
    except Stuck as e:
        assert e.code == ExitCode.STUCK == 12
        return str(e), clock["t"]
    return None, clock["t"]


def _set(fake, pod: dict) -> None:
    fake.put(PODS, copy.deepcopy(pod))


def test_an_image_that_cannot_be_pulled_fails_the_run_ten_minutes_in_not_at_the_deadline(kube, jobset):
    name = jobset["metadata"]["name"]

    def script(t, fake):
        # the kubelet alternates ErrImagePull (a try) and ImagePullBackOff (waiting for the next one)
        pull = f'rpc error: code = NotFound desc = failed to pull and unpack image "{IMAGE}": not found'
        reason, msg = (("ErrImagePull", pull) if int(t / POLL_S) % 2
                       else ("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"'))
        _set(fake, _pod(f"{name}-capture-0-0-abcde", "capture", name,
                        init=[_waiting("prepare", reason, msg)]))

    why, t = _play(kube, jobset, script)
    assert STUCK_AFTER_S <= t <= STUCK_AFTER_S + POLL_S
    assert why.startswith(f"pod {name}-capture-0-0-abcde: container prepare cannot start for ")
    assert "the image cannot be pulled" in why and IMAGE in why
    assert t < jobset["spec"]["replicatedJobs"][1]["template"]["spec"]["activeDeadlineSeconds"] / 1000


def test_a_missing_secret_fails_the_run_with_the_kubelets_reason(kube, jobset):
    name = jobset["metadata"]["name"]

    def script(t, fake):
        _set(fake, _pod(f"{name}-extract-0-1-fghij", "extract", name, init=[
            _waiting("prepare", "CreateContainerConfigError", 'secrets "eagle-jobs-store" not found')]))

    why, t = _play(kube, jobset, script)
    assert STUCK_AFTER_S <= t <= STUCK_AFTER_S + POLL_S
    assert "a Secret or ConfigMap it names is missing" in why and 'secrets "eagle-jobs-store" not found' in why


def test_a_vllm_sidecar_that_keeps_exiting_fails_the_run_with_its_last_words(kube, jobset):
    name = jobset["metadata"]["name"]
    last = {"exitCode": 1, "reason": "Error", "startedAt": "2026-12-06T00:00:00Z",
            "finishedAt": "2026-12-06T00:01:00Z",
            "message": "INFO loading\nValueError: --tensor-parallel-size 8 exceeds the 4 GPUs visible\n"}

    def script(t, fake):
        restarts = min(SIDECAR_EXITS, int(t / POLL_S))  # CrashLoopBackOff: one more exit per poll here
        side = (_waiting("vllm", "CrashLoopBackOff", "back-off 40s restarting failed container=vllm", restarts, last)
                if restarts else _running("vllm"))
        _set(fake, _pod(f"{name}-capture-0-0-abcde", "capture", name,
                        init=[{**_running("prepare"), "state": {"terminated": {"exitCode": 0}}}, side],
                        main=[_running("worker")]))

    why, t = _play(kube, jobset, script)
    assert t == SIDECAR_EXITS * POLL_S  # at the third exit, not ten minutes of backoff later
    assert f"sidecar vllm exited {SIDECAR_EXITS} times, last with code 1" in why
    assert "exceeds the 4 GPUs visible" in why


def test_a_slow_pull_that_succeeds_and_a_loading_server_are_left_alone_and_the_guard_ends_with_the_run(kube, jobset):
    name = jobset["metadata"]["name"]
    stages = [rj["name"] for rj in jobset["spec"]["replicatedJobs"] if rj["name"] != "guard"]

    def script(t, fake):
        pulling = t < STUCK_AFTER_S - POLL_S  # fails to pull for a while (a registry hiccup), then runs
        init = [_waiting("prepare", "ImagePullBackOff", f'Back-off pulling image "{IMAGE}"')] if pulling else [
            {**_running("prepare"), "state": {"terminated": {"exitCode": 0}}}, _running("vllm")]
        # then the same pod pulls again on a restart: the earlier wait does not count
        if STUCK_AFTER_S * 1.2 < t < STUCK_AFTER_S * 1.8:
            init = [_waiting("prepare", "ImagePullBackOff", f'Back-off pulling image "{IMAGE}"')]
        _set(fake, _pod(f"{name}-capture-0-0-abcde", "capture", name, init=init,
                        main=[] if pulling else [_waiting("worker", "ContainerCreating", "")]))
        if t >= 3 * STUCK_AFTER_S:  # JobSet's status once every stage's Job has succeeded
            js = fake.get(JS_COLL, name)
            fake.set_status(JS_COLL, name, {"replicatedJobsStatus": [
                {"name": s, "succeeded": 1, "ready": 0, "failed": 0, "active": 0, "suspended": 0} for s in stages]})
            assert js is not None

    why, t = _play(kube, jobset, script)
    assert why is None and 3 * STUCK_AFTER_S <= t <= 3 * STUCK_AFTER_S + POLL_S


def _train_pod(jobset: dict, node: str) -> dict:
    """A running train pod as the rendered overlay makes it, bound to `node`."""
    name = jobset["metadata"]["name"]
    (rj,) = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "train"]
    spec = copy.deepcopy(rj["template"]["spec"]["template"]["spec"])
    pod = _pod(f"{name}-train-0-0-klmno", "train", name, main=[_running("worker")])
    pod["spec"] = {**spec, "nodeName": node}
    pod["status"]["phase"] = "Running"
    return pod


def _evicted(pod: dict, at: str) -> dict:
    """What the taint manager leaves on a pod of an unreachable node (kubernetes v1.33.2
    pkg/controller/tainteviction/taint_eviction.go:129-139 adds the condition, then deletes the pod; the API
    server sets deletionTimestamp and deletionGracePeriodSeconds from the pod's grace), and the node lifecycle
    controller's Ready=False (pkg/controller/util/node MarkPodsNotReady). No kubelet answers, so the phase
    stays Running."""
    pod = copy.deepcopy(pod)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    pod["metadata"].update(deletionTimestamp=at, deletionGracePeriodSeconds=grace)
    pod["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
         "message": "Taint manager: deleting due to NoExecute taint"},
        {"type": "Ready", "status": "False"}]
    return pod


def test_a_pod_on_a_lost_node_fails_the_run_minutes_after_its_grace_not_at_the_deadline(kube, jobset):
    """The node stops answering at t = 0: NotReady at 50 s, the pod deleted at 350 s (the default 300 s
    toleration of unreachable), and then it terminates for ever: the Job replaces it only once it is gone."""
    pod = _train_pod(jobset, "gpu-node-7")
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace == 300  # the train pod's one SIGTERM save (docs/OPERATIONS.md#preemption)
    evicted = 350.0

    def script(t, fake):
        _set(fake, _evicted(pod, "2026-12-06T00:05:50Z") if t >= evicted else pod)
        if t >= 4 * (evicted + grace + STUCK_AFTER_S):  # stands for the deadline, days later: the run failed
            fake.set_status(JS_COLL, pod["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"], {
                "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]})

    why, t = _play(kube, jobset, script)
    assert why is not None, f"the guard let the lost node's pod wait {t:.0f} s, until the run failed by itself"
    assert evicted + grace + STUCK_AFTER_S <= t <= evicted + grace + STUCK_AFTER_S + 2 * POLL_S
    assert why.startswith(f"pod {pod['metadata']['name']} on node gpu-node-7: terminating for ")
    assert f"past its {grace} s grace (DeletionByTaintManager: Taint manager: deleting due to NoExecute taint)" in why
    assert "kubectl taint node gpu-node-7 node.kubernetes.io/out-of-service=nodeshutdown:NoExecute" in why
    (rj,) = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "train"]
    assert t < rj["template"]["spec"]["activeDeadlineSeconds"] / 100


def test_a_pod_that_ends_within_its_grace_is_left_alone(kube, jobset):
    """A deleted pod whose kubelet answers ends within its grace (a preemption's SIGTERM save) and is gone, or
    ends Failed and waits for the Job controller's finalizer: neither is a lost node."""
    name = jobset["metadata"]["name"]
    stages = [rj["name"] for rj in jobset["spec"]["replicatedJobs"] if rj["name"] != "guard"]
    pod = _train_pod(jobset, "gpu-node-3")
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    failed = copy.deepcopy(pod)
    failed["metadata"]["name"] = f"{name}-train-0-1-pqrst"
    failed = _evicted(failed, "2026-12-06T00:00:00Z")
    failed["status"]["phase"] = "Failed"

    def script(t, fake):
        if t < grace - POLL_S:
            _set(fake, _evicted(pod, "2026-12-06T00:00:00Z"))
        elif fake.get(PODS, pod["metadata"]["name"]) is not None:
            fake.delete(PODS, pod["metadata"]["name"])
        _set(fake, failed)
        if t >= 2 * (grace + STUCK_AFTER_S):
            fake.set_status(JS_COLL, name, {"replicatedJobsStatus": [
                {"name": s, "succeeded": 1, "ready": 0, "failed": 0, "active": 0, "suspended": 0} for s in stages]})

    why, t = _play(kube, jobset, script)
    assert why is None and t >= 2 * (grace + STUCK_AFTER_S)


def test_status_and_watch_name_the_guards_reason():
    """The JobSet fails through the guard's Job (podFailurePolicy FailJob on exit 12): watch exits 26, and the
    guard's pod shows its last line (terminationMessagePolicy FallbackToLogsOnError)."""
    from kubernetes.client import ApiClient

    from eagle_jobs.cluster.api import pod_state

    states = {"stages": {"guard": {"reason": "PodFailurePolicy", "message": (
        "Container guard for pod eagle-jobs/x-guard-0-0-abcde failed with exit code 12 "
        "matching FailJob rule at index 1")}}}
    assert failure_exit(None, NS, "x", states) == WatchExit.STUCK == 26
    pod = ApiClient()._ApiClient__deserialize({
        "metadata": {"name": "x-guard-0-0-abcde"}, "spec": {"containers": [{"name": "guard", "image": IMAGE}]},
        "status": {"phase": "Failed", "containerStatuses": [{
            "name": "guard", "image": IMAGE, "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 12, "reason": "Error", "message": (
                "guarding JobSet x\neagle-jobs: error: pod x-capture-0-0-abcde: container prepare cannot start "
                "for 600 s: the image cannot be pulled\n")}}}]}}, "V1Pod")
    assert pod_state(pod) == ("Failed", "guard exit 12 (Error): eagle-jobs: error: pod x-capture-0-0-abcde: "
                                        "container prepare cannot start for 600 s: the image cannot be pulled")


@pytest.mark.parametrize("overlay", ["dev", "smoke", "full", "full-multinode", "full-b200", "full-gb200"])
def test_the_guards_success_is_part_of_the_runs_and_it_starts_with_the_run(overlay):
    """JobSet's successPolicy without targetReplicatedJobs counts every replicatedJob (pkg/controllers/
    success_policy.go line 33, v0.8.2 and v0.12.0): the run completes once the guard has exited 0 after the
    stages; and the guard depends on nothing, so it runs from the first stage on."""
    (js,) = [d for d in kustomize(REPO / "k8s/overlays" / overlay) if d["kind"] == "JobSet"]
    assert js["spec"]["successPolicy"] == {"operator": "All"}
    guard_rj = js["spec"]["replicatedJobs"][-1]
    assert guard_rj["name"] == "guard" and "dependsOn" not in guard_rj
    pod = guard_rj["template"]["spec"]["template"]["spec"]
    assert [c["args"] for c in pod["containers"]] == [["guard"]] and pod["serviceAccountName"] == "eagle-jobs-guard"
