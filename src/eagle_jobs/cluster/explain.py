"""Explaining a failure: which exit code failed the run (WatchExit, from the Job's podFailurePolicy
message or the pods' exit codes), each pod's worker log, and the events of a pod that never started."""

from __future__ import annotations

import re

from eagle_jobs.cluster.api import WatchExit, jobset_name, pod_name, pod_state
from eagle_jobs.errors import ExitCode

# the codes podFailurePolicy fails a run on at once (k8s/base/pipeline.yaml), in the containers it reads
FAIL_FAST = {int(ExitCode.USAGE): WatchExit.BAD_INPUT, int(ExitCode.BAD_INPUT): WatchExit.BAD_INPUT,
             int(ExitCode.STORE): WatchExit.STORE, int(ExitCode.STUCK): WatchExit.STUCK}

FAILING_CONTAINERS = ("worker", "prepare", "guard")


def failure_exit(api, namespace: str, run_id: str, states: dict) -> WatchExit:
    """Classify a failed run. Bad input first: the Job that podFailurePolicy failed says which container
    exited with what ("Container prepare for pod ... failed with exit code 3 matching FailJob rule at
    index 1", pkg/controller/job/pod_failure_policy.go), prepare's code as much as the worker's. Then
    a deadline, then the exit codes the pods still show."""
    from kubernetes import client

    for s in states["stages"].values():
        m = re.search(r"failed with exit code (\d+)", s.get("message") or "")
        if s.get("reason") == "PodFailurePolicy" and m and int(m[1]) in FAIL_FAST:
            return FAIL_FAST[int(m[1])]
    reasons = {s["reason"] for s in states["stages"].values() if s.get("reason")}
    if "DeadlineExceeded" in reasons:
        return WatchExit.DEADLINE
    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={states['jobset']}").items
    codes = set()
    for p in pods:
        st = p.status
        if st is None:  # always set on a listed pod (typed Optional by the client, as every field)
            continue
        for cs in (st.container_statuses or []) + (st.init_container_statuses or []):
            term = cs.state.terminated if cs.state else None
            if cs.name in FAILING_CONTAINERS and term is not None and term.exit_code:
                codes.add(term.exit_code)
    return next((exit_ for code, exit_ in FAIL_FAST.items() if code in codes), WatchExit.FAILED)


def logs(api, namespace: str, run_id: str, stage: str | None = None, tail: int | None = None) -> str:
    """Each pod's worker log. A worker that has not started yet has no log (the API answers 400):
    then the vLLM sidecar's log, where there is one, and the pod's events say why it waits."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api)
    sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(run_id)}"
    if stage:
        sel += f",jobset.sigs.k8s.io/replicatedjob-name={stage}"

    def read(pod: str, container: str) -> str | None:
        try:
            return core.read_namespaced_pod_log(pod, namespace, container=container, tail_lines=tail)
        except ApiException as e:
            if e.status in (400, 404):  # waiting to start, or no such container yet
                return None
            raise

    out = []
    for p in sorted(core.list_namespaced_pod(namespace, label_selector=sel).items, key=pod_name):
        name = pod_name(p)
        text = read(name, "worker")
        if text is not None:
            out.append(f"==> {name} [worker] <==\n{text}")
            continue
        for c in (c.name for c in (p.spec.init_containers if p.spec else None) or []):
            text = read(name, c)
            if text is not None:
                out.append(f"==> {name} [{c}] <==\n{text}")
        phase, why = pod_state(p)
        out.append(f"==> {name}: {phase}{f' ({why})' if why else ''}; worker not started <==")
        out.append(pod_events(core, namespace, name))
    return "\n".join(out)


def pod_events(core, namespace: str, pod: str) -> str:
    """The pod's events, oldest first, as `kubectl describe` lists them."""
    from kubernetes.client.exceptions import ApiException

    try:
        evs = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}").items
    except ApiException as e:
        if e.status == 403:
            return "  (events not readable: bind the submitter Role of k8s/cluster-setup, which may list events)"
        raise
    evs.sort(key=lambda e: str(e.last_timestamp or e.event_time or e.metadata.creation_timestamp or ""))
    lines = [f"  {e.type or '':8} {e.reason or '':22} {(e.message or '').strip()}"
             + (f" (x{e.count})" if (e.count or 1) > 1 else "") for e in evs]
    return "\n".join(["  events:"] + lines) if lines else "  events: none"
