"""The cluster's API as every operator command reaches it: the JobSet API's coordinates, a run's JobSet
name, the client (from --kubeconfig, $KUBECONFIG or the pod's service account), watch's exit codes, and
reading a JobSet's conditions and a pod's state."""

from __future__ import annotations

import re
from datetime import UTC
from enum import IntEnum
from typing import TYPE_CHECKING, cast

from eagle_jobs.errors import BadInput

if TYPE_CHECKING:
    from kubernetes.client import V1Pod


GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"

FIELD_MANAGER = "eagle-jobs"

APPLY = "application/apply-patch+yaml"



class WatchExit(IntEnum):
    SUCCEEDED = 0
    BAD_INPUT = 20  # a stage's worker or prepare failed with exit 3 (or 2, usage): fix the recipe or data
    STORE = 21  # a stage failed with exit 4: bucket or credentials
    FAILED = 22  # a stage exhausted its retries (any other failure)
    DEADLINE = 23  # a stage ran past activeDeadlineSeconds
    GONE = 24  # the JobSet does not exist or was deleted
    TIMEOUT = 25  # --timeout passed before the pipeline finished
    STUCK = 26  # the run's guard failed it: a pod could not start (image, Secret, vLLM sidecar)

# JobSet's webhook (pkg/webhooks/jobset_webhook.go, v0.8 to v0.12) checks the longest generated pod
# name, <jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<5 random>, as an RFC-1035 label of <= 63
# characters: with "evaluate" (one Job, one pod) that leaves 63 - len("-evaluate-0-0-abcde") = 44.
MAX_JOBSET_NAME = 44



def jobset_name(run_id: str) -> str:
    from eagle_jobs.runid import check_run_id

    check_run_id(run_id, "it names the JobSet")  # admitted run ids map onto RFC-1035 labels (runid.py)
    name = re.sub(r"[^a-z0-9-]+", "-", f"eagle-jobs-{run_id}".lower()).strip("-")
    if len(name) > MAX_JOBSET_NAME:
        raise BadInput(f"run id '{run_id}' is too long for a JobSet name "
                       f"(max {MAX_JOBSET_NAME - len('eagle-jobs-')} characters): "
                       "JobSet's webhook would reject its pods")
    return name



def api_client(kubeconfig: str | None = None):
    """A client for --kubeconfig if given (only that), else $KUBECONFIG (or ~/.kube/config when unset,
    as kubectl reads it), else the pod's service account; NoCluster (exit 8) names each one tried."""
    import os

    from kubernetes import client, config

    from eagle_jobs.errors import NoCluster

    env = os.environ.get("KUBECONFIG")
    what, path = (("--kubeconfig", kubeconfig) if kubeconfig else ("$KUBECONFIG", env) if env else
                  ("~/.kube/config ($KUBECONFIG unset)", "~/.kube/config"))
    tried = [] if kubeconfig else ["--kubeconfig: not given"]
    try:
        config.load_kube_config(config_file=path)
        return client.ApiClient()
    except Exception as e:  # noqa: BLE001 - a missing, unreadable or invalid file: say which and why
        tried.append(f"{what}: {first_line(e)}" if path.startswith("~") else f"{what} {path}: {first_line(e)}")
    if kubeconfig:  # asked for this file: never fall back to another cluster
        raise NoCluster(f"{tried[0]}; fix the file or pass another --kubeconfig")
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except Exception as e:  # noqa: BLE001 - not in a pod, or no service account mounted
        tried.append(f"in-cluster: {first_line(e)}")
    raise NoCluster(f"no cluster configuration ({'; '.join(tried)}): pass --kubeconfig <file> or set $KUBECONFIG")



def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]



def read_jobset(api, namespace: str, name: str) -> dict:
    """The JobSet as the API server returns it: its JSON object (the client types a custom object as `object`)."""
    from kubernetes import client

    return cast(dict, client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                                                name))



def condition(obj: dict, type_: str) -> dict | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None



def age(ts) -> str:
    """'12m' since a timestamp the client parsed (None: unknown)."""
    if ts is None:
        return "?"
    from datetime import datetime

    s = int((datetime.now(UTC) - ts).total_seconds())
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"



def pod_state(p) -> tuple[str, str]:
    """(phase, why): a Job counts a pod as active from the moment it exists, so a pod that cannot be
    scheduled, cannot pull its image, crash-loops in an init container or is still loading a 1T model
    all read "Running" at the Job level. This says which, as kubectl's STATUS column does, and more."""
    st = p.status
    phase = (st.phase if st else None) or "Pending"
    if p.metadata.deletion_timestamp is not None:
        return phase, "Terminating"
    if phase in ("Succeeded", "Failed"):
        for cs in (st.container_statuses or []) + (st.init_container_statuses or []):
            term = cs.state.terminated if cs.state else None
            # the worker's (or the guard's) code; or prepare's, when it failed and the worker never ran;
            # with the last line it printed (terminationMessagePolicy: FallbackToLogsOnError)
            if term is not None and (cs.name in ("worker", "guard") or (cs.name == "prepare" and term.exit_code)):
                said = (term.message or "").strip().splitlines()[-1:] if term.exit_code else []
                return phase, (f"{cs.name} exit {term.exit_code}" + (f" ({term.reason})" if term.reason else "")
                               + (f": {said[0]}" if said else ""))
        return phase, st.reason or ""
    for c in (st.conditions or []):
        if c.type == "PodScheduled" and c.status == "False":
            return phase, f"{c.reason or 'Unschedulable'}: {c.message or ''}".strip()
    side = sidecars(p)
    for cs in (st.init_container_statuses or []):
        w = cs.state.waiting if cs.state else None
        term = cs.state.terminated if cs.state else None
        run = cs.state.running if cs.state else None
        if w is not None and w.reason not in (None, "PodInitializing"):
            return phase, f"Init:{w.reason} ({cs.name}" + (f": {w.message}" if w.message else "") + \
                f"; {cs.restart_count} restarts)"
        if term is not None and term.exit_code:
            return phase, f"Init:Error ({cs.name} exit {term.exit_code})"
        if run is not None and cs.name in side and not cs.started:
            return phase, f"Init:{cs.name} starting for {age(run.started_at)} (not ready yet: loading the model)"
        if run is not None and cs.name not in side:
            return phase, f"Init:{cs.name} running"
    for cs in (st.container_statuses or []):
        w = cs.state.waiting if cs.state else None
        if w is not None and w.reason:
            return phase, f"{w.reason} ({cs.name}" + (f": {w.message}" if w.message else "") + \
                (f"; {cs.restart_count} restarts)" if cs.restart_count else ")")
    if phase == "Running":
        restarts = sum(cs.restart_count or 0 for cs in (st.container_statuses or []))
        return phase, f"{restarts} restarts" if restarts else ""
    return phase, st.reason or ""



def sidecars(pod) -> set[str]:
    """The pod's restartable init containers (restartPolicy: Always): the vLLM sidecar."""
    return {c.name for c in (pod.spec.init_containers if pod.spec else None) or []
            if getattr(c, "restart_policy", None) == "Always"}


def pod_name(obj: V1Pod) -> str:
    """A listed pod's name: always set (the client's OpenAPI models type every field Optional)."""
    return obj.metadata.name if obj.metadata and obj.metadata.name else ""
