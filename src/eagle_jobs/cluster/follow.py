"""Following a run: `status` (each stage's JobSet/Job state, its pods, the store's progress) and
`watch`, which exits 0 only when the pipeline succeeded and with a distinct code for each kind of
failure (WatchExit; docs/OPERATIONS.md#watch-exit-codes)."""

from __future__ import annotations

import time

from eagle_jobs.cluster.api import (
    GROUP,
    PLURAL,
    VERSION,
    WatchExit,
    condition,
    jobset_name,
    pod_name,
    pod_state,
    read_jobset,
)
from eagle_jobs.cluster.explain import failure_exit
from eagle_jobs.layout import STAGES, StageName
from eagle_jobs.progress import console


def stage_states(api, namespace: str, run_id: str) -> dict:
    """JobSet-level state and, per stage, the Job's state and extraction indexes."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    name = jobset_name(run_id)
    try:
        js = read_jobset(api, namespace, name)
    except ApiException as e:
        if e.status == 404:
            return {"jobset": name, "state": "NotFound", "stages": {}}
        raise
    jobs = client.BatchV1Api(api).list_namespaced_job(
        namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
    # the JobSet's own stages, in order: a verifier-mirror stage comes first where an overlay adds it
    names = [rj["name"] for rj in (js.get("spec") or {}).get("replicatedJobs") or []] or STAGES
    stages: dict = {s: {"state": "Waiting"} for s in names}
    for j in jobs:
        # a listed Job always has metadata and status (the client's OpenAPI models type every field Optional)
        st = j.status
        if j.metadata is None or st is None:
            continue
        stage = (j.metadata.labels or {}).get("jobset.sigs.k8s.io/replicatedjob-name")
        if stage not in stages:
            continue
        conds = {c.type: c for c in (st.conditions or []) if c.status == "True"}
        state = "Running"
        if "Complete" in conds:
            state = "Complete"
        elif "Failed" in conds:
            state = "Failed"
        elif not (st.active or 0) and not (st.succeeded or 0) and not (st.failed or 0):
            state = "Pending"
        stages[stage] = {"state": state, "active": st.active or 0, "succeeded": st.succeeded or 0,
                         "failed": st.failed or 0, "completed_indexes": st.completed_indexes or "",
                         "failed_indexes": st.failed_indexes or "",
                         "reason": conds["Failed"].reason if "Failed" in conds else None,
                         "message": conds["Failed"].message if "Failed" in conds else None}
    state = "Running"
    if condition(js, "Completed"):
        state = "Completed"
    elif condition(js, "Failed"):
        state = "Failed"
    elif condition(js, "Suspended"):
        state = "Suspended"
    for stage, pods in pod_states(api, namespace, name).items():
        if stage in stages:
            stages[stage]["pods"] = pods
    return {"jobset": name, "state": state, "stages": stages,
            "resource_version": js["metadata"].get("resourceVersion")}


def pod_states(api, namespace: str, jobset: str) -> dict[str, list[dict]]:
    """Per stage, each pod's name, phase and why."""
    from kubernetes import client

    out: dict[str, list[dict]] = {}
    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={jobset}").items
    for p in sorted(pods, key=pod_name):
        stage = ((p.metadata.labels if p.metadata else None) or {}).get("jobset.sigs.k8s.io/replicatedjob-name", "?")
        phase, why = pod_state(p)
        out.setdefault(stage, []).append({"name": pod_name(p), "phase": phase, "why": why})
    return out


def store_progress(store, run_id: str) -> dict:
    from eagle_jobs.store import Stage

    out = {}
    for s in STAGES:
        st = Stage(store, run_id, StageName(s).dir)
        out[s] = {"committed_shards": len(st.store.list(st.key("manifests"))), "complete": st.is_complete()}
    return out


def print_status(states: dict, progress: dict | None) -> None:
    from rich.table import Table

    t = Table(title=f"{states['jobset']}: {states['state']}")
    for c in ("stage", "state", "pods ok/active/failed", "indexes done", "indexes failed", "store"):
        t.add_column(c)
    for s in states["stages"] or STAGES:
        x = states["stages"].get(s, {"state": "-"})
        p = (progress or {}).get(s, {})
        t.add_row(s, x["state"], f"{x.get('succeeded', 0)}/{x.get('active', 0)}/{x.get('failed', 0)}",
                  x.get("completed_indexes", ""), x.get("failed_indexes", ""),
                  f"{p['committed_shards']} shards{' , complete' if p['complete'] else ''}" if p else "-")
    console.print(t)
    for s, x in states["stages"].items():  # why a stage failed, in the Job controller's words
        if x.get("reason"):
            console.print(f"  {s} failed: {x['reason']}: {x.get('message') or ''}", soft_wrap=True, markup=False,
                          highlight=False)
    pods = [(s, pod) for s, x in states["stages"].items() for pod in x.get("pods", [])]
    if pods:
        t = Table(title="pods")
        for c in ("stage", "pod", "phase", "why"):
            t.add_column(c)
        for s, pod in pods:
            t.add_row(s, pod["name"], pod["phase"], pod["why"])
        console.print(t)


def heartbeat_line(states: dict) -> str:
    """One line that says the watch is alive and where the run stands."""
    parts = []
    for s, x in states["stages"].items():
        if x["state"] in ("Waiting", "Complete"):
            continue
        pods = x.get("pods", [])
        why = "; ".join(f"{p['name'].rsplit('-', 1)[0]} {p['phase']}" + (f" {p['why']}" if p["why"] else "")
                        for p in pods[:4]) + (f"; +{len(pods) - 4} pods" if len(pods) > 4 else "")
        parts.append(f"{s} {x['state']}" + (f" [{why}]" if why else ""))
    done = [s for s, x in states["stages"].items() if x["state"] == "Complete"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (f"{stamp} {states['jobset']} {states['state']}: " + (", ".join(parts) or "nothing running") +
            (f" (done: {', '.join(done)})" if done else ""))

HEARTBEAT_S = 600.0


def watch(api, namespace: str, run_id: str, timeout_s: float | None = None, store=None,
          heartbeat_s: float = HEARTBEAT_S) -> WatchExit:
    """Follow the JobSet until it finishes; survives dropped watches and 410 Gone. A table on every
    change of a stage or pod state; between changes, a heartbeat line every heartbeat_s."""
    from kubernetes import client
    from kubernetes import watch as kwatch
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout_s if timeout_s else None
    name = jobset_name(run_id)
    custom = client.CustomObjectsApi(api)
    rv = None
    last = None
    spoke = time.monotonic()
    while True:
        states = stage_states(api, namespace, run_id)
        if states["state"] == "NotFound":
            return WatchExit.GONE
        # a pod's "starting for 3m" changes every poll: its age is not a change
        pod_keys = {k: tuple((p["name"], p["phase"], p["why"].split(" for ")[0]) for p in v.get("pods", []))
                    for k, v in states["stages"].items()}
        summary = (states["state"], tuple(sorted((k, v["state"], pod_keys[k]) for k, v in states["stages"].items())))
        if summary != last:
            print_status(states, store_progress(store, run_id) if store is not None else None)
            last, spoke = summary, time.monotonic()
        elif time.monotonic() - spoke >= heartbeat_s:
            console.print(heartbeat_line(states), soft_wrap=True, markup=False, highlight=False)
            spoke = time.monotonic()
        if states["state"] == "Completed":
            return WatchExit.SUCCEEDED
        if states["state"] == "Failed":
            return failure_exit(api, namespace, run_id, states)
        if deadline and time.monotonic() > deadline:
            return WatchExit.TIMEOUT
        rv = rv or states.get("resource_version")
        # wake up for the heartbeat, and at least every 5 minutes: pod changes are not JobSet events
        wait = max(1.0, min(300.0, heartbeat_s - (time.monotonic() - spoke)))
        remaining = int(max(1, min(wait, deadline - time.monotonic()))) if deadline else int(wait)
        w = kwatch.Watch()
        try:
            for ev in w.stream(custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                               field_selector=f"metadata.name={name}", resource_version=rv,
                               timeout_seconds=remaining):
                obj = ev["object"]
                rv = obj.get("metadata", {}).get("resourceVersion", rv)
                if ev["type"] == "DELETED":
                    return WatchExit.GONE
                break  # re-read the JobSet and its Jobs on every change
        except ApiException as e:
            if e.status == 410:  # our resourceVersion is too old: list again
                rv = None
                continue
            raise
        except Exception:  # noqa: BLE001 - a dropped connection: reconnect from the last version seen
            time.sleep(0.2)
        finally:
            w.stop()
