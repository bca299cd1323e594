"""What a failed pod does to a run, played on every overlay's render.

tests/k8s_failure_sim.py applies Kubernetes' podFailurePolicy and Job limits and JobSet's
failurePolicy in the order their controllers do (it cites the sources); here it is fed with pod
outcomes and must give: an index or stage out of retries restarts the run (RestartJobSet) and the
run finishes; usage, bad input and store failures (2, 3, 4) from the worker or `prepare` fail the
run at once with reason PodFailurePolicy; an evicted or preempted pod costs nothing whatever it
exited with. Then the Jobs and pods it leaves go through tests/fake_kube.py to `status` and
`watch`, which must name prepare's exit code as they name the worker's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import JOBS, JS, NS, PODS, kustomize
from k8s_failure_sim import failed_pod, match_pod_failure_policy, run_jobset

from eagle_jobs import cluster
from eagle_jobs.cluster import WatchExit

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ["dev", "smoke", "full", "full-multinode", "qwen3-8b-1gpu"]
OOM = failed_pod(worker=137)  # the kernel's OOM kill: retried


@pytest.fixture(scope="module")
def jobsets() -> dict[str, dict]:
    out = {}
    for o in OVERLAYS:
        (out[o],) = [d for d in kustomize(REPO / "k8s/overlays" / o) if d["kind"] == "JobSet"]
    return out


def _spec(js: dict, stage: str) -> dict:
    return next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == stage)["template"]["spec"]


def _stages(js: dict) -> list[str]:
    return [rj["name"] for rj in js["spec"]["replicatedJobs"]]


def _containers(js: dict, stage: str) -> list[str]:
    """The containers whose exit codes podFailurePolicy reads in this stage: the worker, and prepare; the
    guard's own container in the run's guard."""
    pod = _spec(js, stage)["template"]["spec"]
    if stage == "guard":
        return ["guard"]
    return ["worker"] + [c["name"] for c in pod.get("initContainers", []) if c["name"] == "prepare"]


def test_the_simulator_matches_kubernetes_own_cases():
    """Cases of TestMatchPodFailurePolicy (pkg/controller/job/pod_failure_policy_test.go @1892e4de),
    namespace default, pod mypod."""
    def pod(statuses=(), init=(), conditions=()):
        term = [{"name": n, "state": {"terminated": {"exitCode": c}}} for n, c in statuses]
        return {"containerStatuses": term, "conditions": list(conditions),
                "initContainerStatuses": [{"name": n, "state": {"terminated": {"exitCode": c}}} for n, c in init]}

    def rule(action, op="In", values=(), conds=None):
        return {"action": action, **({"onPodConditions": conds} if conds else
                                     {"onExitCodes": {"operator": op, "values": list(values)}})}

    mypod = {"namespace": "default", "name": "mypod"}
    # "second jobfail rule matched for exit codes"
    got = match_pod_failure_policy({"rules": [rule("Count", values=[1, 2, 3]), rule("FailJob", values=[4, 5, 6])]},
                                   mypod, pod([("main-container", 6)]))
    assert got == ("Container main-container for pod default/mypod failed with exit code 6 matching FailJob "
                   "rule at index 1", True, "FailJob")
    # "unknown action for rule matching by exit codes - skip rule with unknown action"
    got = match_pod_failure_policy({"rules": [rule("UnknownAction", values=[1, 2]), rule("FailJob", values=[2, 3])]},
                                   mypod, pod([("main-container", 2)]))
    assert got == ("Container main-container for pod default/mypod failed with exit code 2 matching FailJob "
                   "rule at index 1", True, "FailJob")
    # "successful containers are skipped by the rules"
    got = match_pod_failure_policy({"rules": [rule("FailJob", "NotIn", [111])]}, mypod,
                                   pod([("main-container", 111), ("suppport-container", 0)],
                                       init=[("init-container", 0)]))
    assert got == (None, True, None)
    # "ignore rule matched for pod conditions"
    disrupted = [{"type": "DisruptionTarget", "status": "True"}]
    got = match_pod_failure_policy({"rules": [rule("Ignore", conds=disrupted)]}, mypod, pod(conditions=disrupted))
    assert got == (None, False, "Ignore")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_extraction_index_out_of_retries_restarts_the_run_which_then_finishes(jobsets, overlay):
    js = jobsets[overlay]
    ex = _spec(js, "extract")
    last = ex["completions"] - 1
    per_index = ex["backoffLimitPerIndex"]
    assert run_jobset(js, []).state == "Completed"
    # backoffLimitPerIndex retries of one index stay inside the Job
    run = run_jobset(js, [{"extract": {"fail": [(last, OOM)] * per_index}}])
    assert (run.state, run.restarts) == ("Completed", 0)
    # one more and the index is out of retries: the stage restarts instead of the run failing
    run = run_jobset(js, [{"extract": {"fail": [(last, OOM)] * (per_index + 1)}}])
    assert (run.state, run.restarts) == ("Completed", 1), run


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_stage_that_keeps_running_out_of_retries_or_time_fails_after_max_restarts(jobsets, overlay):
    js = jobsets[overlay]
    most = js["spec"]["failurePolicy"]["maxRestarts"]
    train = _spec(js, "train")
    cases = {  # each restarts the run; again and again, and the run fails
        "MaxFailedIndexesExceeded": {
            "extract": {"fail": [(0, OOM)] * (_spec(js, "extract")["backoffLimitPerIndex"] + 1)}},
        "BackoffLimitExceeded": {"train": {"fail": [(0, OOM)] * (train["backoffLimit"] + 1)}},
        "DeadlineExceeded": {"train": {"deadline": True}},
    }
    for reason, attempt in cases.items():
        once = run_jobset(js, [attempt])
        assert (once.state, once.restarts) == ("Completed", 1), (reason, once)
        run = run_jobset(js, [attempt] * (most + 1))
        assert (run.state, run.reason, run.restarts) == ("Failed", "ReachedMaxRestarts", most), reason
        assert run.failed_job.condition[1] == reason


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_usage_bad_input_and_store_failures_fail_the_run_at_once_in_every_stage(jobsets, overlay):
    js = jobsets[overlay]
    for stage in _stages(js):
        index = _spec(js, stage)["completions"] - 1
        for container in _containers(js, stage):
            # usage, bad input, store; the guard: usage, no RBAC, a pod of the run that cannot start (12)
            for code in (2, 3, 12) if container == "guard" else (2, 3, 4):
                pod = failed_pod(**{container: code})
                run = run_jobset(js, [{stage: {"fail": [(index, pod)]}}])
                assert (run.state, run.reason, run.restarts) == ("Failed", "FailJobSetFailurePolicyAction", 0), \
                    (stage, container, code, run)
                kind, reason, message = run.failed_job.condition
                assert (run.failed_job.stage, reason) == (stage, "PodFailurePolicy")
                assert f"Container {container} for pod" in message and f"failed with exit code {code}" in message
        # after a restart too: bad input wins over any retry left
        run = run_jobset(js, [{"extract": {"fail": [(0, OOM)] * 9}},
                              {stage: {"fail": [(index, failed_pod(**{_containers(js, stage)[0]: 3}))]}}])
        assert (run.state, run.reason, run.restarts) == ("Failed", "FailJobSetFailurePolicyAction", 1), stage


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_preempted_pod_costs_nothing_whatever_it_exits_with(jobsets, overlay):
    """DisruptionTarget first: a preempted worker that exits 3 or 4 on its way out (a SIGTERM save that
    found the store gone) must not fail the run, and evictions never use up retries."""
    js = jobsets[overlay]
    for stage in _stages(js):
        rules = _spec(js, stage)["podFailurePolicy"]["rules"]
        assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        evicted = [(0, failed_pod(worker=c, disrupted=True)) for c in (143, 3, 4, 137)] * 5
        run = run_jobset(js, [{stage: {"fail": evicted}}])
        assert (run.state, run.restarts) == ("Completed", 0), (stage, run)
        job = next(j for j in run.jobs if j.stage == stage)
        assert job.failed == 0 and len(job.pods) == len(evicted)


WATCHED = [  # the last attempt's stage, the failing pod, and what `watch` must exit with
    ("capture", failed_pod(prepare=3), WatchExit.BAD_INPUT, "prepare exit 3"),
    ("evaluate", failed_pod(prepare=4), WatchExit.STORE, "prepare exit 4"),
    ("extract", failed_pod(prepare=2), WatchExit.BAD_INPUT, "prepare exit 2"),
    ("train", failed_pod(worker=4), WatchExit.STORE, "worker exit 4"),
]


@pytest.mark.parametrize("stage,pod,expected,why", WATCHED, ids=[w[3].replace(" ", "-") + "-" + w[0] for w in WATCHED])
def test_status_and_watch_name_prepares_exit_code_as_the_workers(kube, capsys, stage, pod, expected, why):  # noqa: F811
    """eeb302c read only the worker's codes: prepare's exit 3 came out as 22 (FAILED)."""
    fake, kc = kube
    api = cluster.api_client(kc)
    cluster.submit(REPO / "k8s/overlays/full", "pf1", kubeconfig=kc)
    js = fake.get(JS, "eagle-jobs-pf1")
    run = run_jobset(js, [{stage: {"fail": [(0, pod)]}}])
    assert run.reason == "FailJobSetFailurePolicyAction"
    when = "2026-12-01T00:00:00Z"
    for job in run.jobs:
        fake.put(JOBS, job.api_object(when))
        for p in job.api_pods():
            fake.put(PODS, p)
    fake.set_status(JS, "eagle-jobs-pf1", {"conditions": [{
        "type": "Failed", "status": "True", "reason": run.reason,
        "message": "applying FailJobSet failure policy action", "lastTransitionTime": when}]})
    states = cluster.stage_states(api, NS, "pf1")
    assert states["state"] == "Failed"
    assert cluster.failure_exit(api, NS, "pf1", states) == expected
    assert cluster.watch(api, NS, "pf1", timeout_s=30) == expected
    cluster.print_status(states, None)
    out = " ".join(capsys.readouterr().err.split())
    assert why in out and f"{stage} failed: PodFailurePolicy: Container {why.split()[0]}" in out, out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_stage_out_of_retries_fails_watch_as_failed_not_bad_input(jobsets, kube, overlay):  # noqa: F811
    """The other side: OOM kills (137) until maxRestarts is spent read as FAILED (22), never as bad input."""
    fake, kc = kube
    api = cluster.api_client(kc)
    cluster.submit(REPO / "k8s/overlays" / overlay, "pf2", kubeconfig=kc)
    js = fake.get(JS, "eagle-jobs-pf2")
    most = js["spec"]["failurePolicy"]["maxRestarts"]
    run = run_jobset(js, [{"train": {"fail": [(0, OOM)] * 99}}] * (most + 1))
    assert (run.state, run.reason) == ("Failed", "ReachedMaxRestarts")
    for job in run.jobs:
        fake.put(JOBS, job.api_object("2026-12-01T00:00:00Z"))
        for p in job.api_pods():
            fake.put(PODS, p)
    fake.set_status(JS, "eagle-jobs-pf2", {"conditions": [{"type": "Failed", "status": "True", "reason": run.reason,
                                                           "message": "",
                                                           "lastTransitionTime": "2026-12-01T00:00:00Z"}]})
    assert cluster.failure_exit(api, NS, "pf2", cluster.stage_states(api, NS, "pf2")) == WatchExit.FAILED


def test_multinode_training_survives_as_many_incidents_as_a_single_node_does(jobsets):
    """An incident fails every pod of a multi-node train Job (the peers' torchrun ends with the lost rank), and
    the Job controller counts pods: the two-node train Job's budget is the single-node one per node."""
    single, multi = _spec(jobsets["full"], "train"), _spec(jobsets["full-multinode"], "train")
    nodes = multi["completions"]
    assert nodes == 2 and multi["backoffLimit"] == single["backoffLimit"] * nodes
    incidents = single["backoffLimit"]  # what a single-node run survives without a restart
    both = [(i, OOM) for _ in range(incidents) for i in range(nodes)]
    assert run_jobset(jobsets["full"], [{"train": {"fail": [(0, OOM)] * incidents}}]).restarts == 0
    run = run_jobset(jobsets["full-multinode"], [{"train": {"fail": both}}])
    assert (run.state, run.restarts) == ("Completed", 0), run
    run = run_jobset(jobsets["full-multinode"], [{"train": {"fail": both + [(0, OOM), (1, OOM)]}}])
    assert run.restarts == 1 and next(j for j in run.jobs if j.stage == "train").failed == 0  # the next attempt
