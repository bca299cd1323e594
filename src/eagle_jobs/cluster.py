"""Submitting and following a run on a cluster, with the kubernetes Python client.

`submit` renders an overlay for one run id (a unique JobSet name, the run id in
labels, in per-run ConfigMap names and in the store path) and server-side
applies it; `status`, `watch` and `logs` read the JobSet, its Jobs and pods and
the store. `watch` exits 0 only when the pipeline succeeded and with a distinct
code for each kind of failure (WatchExit; docs/OPERATIONS.md#watch-exit-codes).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from datetime import UTC
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, cast

import yaml

from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.layout import STAGES, StageName, content_hash
from eagle_jobs.progress import console

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


# -- render -----------------------------------------------------------------------------
def render(overlay: Path, run_id: str, recipe_path: Path | None = None,
           images: dict[str, str] | None = None) -> list[dict]:
    """The overlay's objects, made specific to one run id."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise BadInput("kubectl not found: install kubectl >= 1.32 (kustomize is built in)")
    if not (overlay / "kustomization.yaml").is_file():
        raise BadInput(f"--overlay {overlay}: no kustomization.yaml there")
    r = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True)
    if r.returncode:
        raise BadInput(f"--overlay {overlay}: kustomize failed: {r.stderr.strip().splitlines()[-1]}")
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    return for_run(docs, run_id, recipe_path, images)


GENERATED = ("eagle-jobs-run", "eagle-jobs-recipe")  # the overlays' configMapGenerator names


def name_suffix(data: dict) -> str:
    """A name suffix from a ConfigMap's data, as kustomize's hashed names are (10 characters)."""
    return content_hash(data, 10)


IMAGE_NAMES = {"capture": "ghcr.io/eagle-jobs/capture", "extract": "ghcr.io/eagle-jobs/extract",
               "train": "ghcr.io/eagle-jobs/train"}


def pin_images(docs: list[dict], images: dict[str, str]) -> list[dict]:
    """Every container of an image that CI built from the commit runs exactly that build: by digest."""
    for name, ref in images.items():
        if name not in IMAGE_NAMES:
            raise BadInput(f"--image {name}=...: no image '{name}' (known: {', '.join(IMAGE_NAMES)})")
        if not re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", ref):
            raise BadInput(f"--image {name}={ref}: pin an image by digest (<registry>/<name>@sha256:<64 hex>), "
                           "as the CI build reports it")
    text = json.dumps(docs)
    for name, ref in images.items():
        text = re.sub(rf'"image": "{re.escape(IMAGE_NAMES[name])}(:[^"@]+)?(@sha256:[0-9a-f]+)?"', f'"image": "{ref}"',
                      text)
    return json.loads(text)


def for_run(docs: list[dict], run_id: str, recipe_path: Path | None = None,
            images: dict[str, str] | None = None) -> list[dict]:
    """The overlay's per-run objects for one run id: the JobSet named for it, its ConfigMaps named
    for it and for their content (a run never reads a ConfigMap another apply changed)."""
    from eagle_jobs.recipe import load_recipe

    if images:
        docs = pin_images(docs, images)

    name = jobset_name(run_id)
    suffix = name.removeprefix("eagle-jobs-")
    renames, out = {}, []
    for d in docs:
        d = json.loads(json.dumps(d))
        d.setdefault("metadata", {}).setdefault("labels", {})["eagle-jobs/run-id"] = suffix
        base = next((g for g in GENERATED if d["kind"] == "ConfigMap" and
                     re.fullmatch(rf"{g}(-[a-z0-9]{{10}})?", d["metadata"]["name"])), None)
        if base is not None:
            if "EAGLE_JOBS_RUN_ID" in d.get("data", {}):
                d["data"]["EAGLE_JOBS_RUN_ID"] = run_id
                if images:  # lineage: train records them, promote copies them next to the draft
                    d["data"]["EAGLE_JOBS_IMAGE_DIGESTS"] = json.dumps(images, sort_keys=True)
            if recipe_path is not None and "recipe.yaml" in d.get("data", {}):
                load_recipe(recipe_path)  # bad recipes stop here, before anything is applied
                d["data"]["recipe.yaml"] = recipe_path.read_text()
            new = f"{base}-{suffix}-{name_suffix(d.get('data', {}))}"
            renames[d["metadata"]["name"]] = new
            d["metadata"]["name"] = new
        if d["kind"] == "JobSet":
            d["metadata"]["name"] = name
        out.append(d)
    for d in out:
        if d["kind"] == "JobSet":
            text = json.dumps(d)
            for old, new in renames.items():
                text = text.replace(f'"name": "{old}"', f'"name": "{new}"')
            d.clear()
            d.update(json.loads(text))
    if not any(d["kind"] == "JobSet" for d in out):
        raise BadInput("the overlay renders no JobSet")
    return out


# -- apply -------------------------------------------------------------------------------
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
        tried.append(f"{what}: {_first_line(e)}" if path.startswith("~") else f"{what} {path}: {_first_line(e)}")
    if kubeconfig:  # asked for this file: never fall back to another cluster
        raise NoCluster(f"{tried[0]}; fix the file or pass another --kubeconfig")
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except Exception as e:  # noqa: BLE001 - not in a pod, or no service account mounted
        tried.append(f"in-cluster: {_first_line(e)}")
    raise NoCluster(f"no cluster configuration ({'; '.join(tried)}): pass --kubeconfig <file> or set $KUBECONFIG")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def apply(api, docs: list[dict]) -> list[str]:
    """Server-side apply each object (field manager eagle-jobs), in dependency order."""
    from kubernetes import client

    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    custom, net = client.CustomObjectsApi(api), client.NetworkingV1Api(api)
    from kubernetes.client.exceptions import ApiException

    # No force: a CI submitter must not silently take over fields another manager owns.
    kw = {"field_manager": FIELD_MANAGER, "_content_type": APPLY}
    # the NetworkPolicy before the JobSet: no vLLM port is ever open without it
    order = {"Namespace": 0, "ServiceAccount": 1, "Role": 1, "RoleBinding": 2, "ConfigMap": 2, "Service": 3,
             "NetworkPolicy": 3, "Deployment": 4, "JobSet": 9}
    done = []
    for d in sorted(docs, key=lambda d: order.get(d["kind"], 5)):
        kind, md = d["kind"], d["metadata"]
        name, ns = md["name"], md.get("namespace")
        try:
            _apply_one(core, apps, rbac, custom, net, kind, name, ns, d, kw)
        except ApiException as e:
            msg = _status_message(e)
            if e.status == 409:
                raise BadInput(f"submit: {kind}/{name} is managed by someone else ({msg}); "
                               "delete it or use another run id") from None
            # the API server's own words: a schema or webhook refusal (an older JobSet's webhook answers 403),
            # an immutable spec (resubmitting a run id with another one), ...: never a guess at the cause
            if e.status == 422 or msg.startswith("admission webhook "):
                raise BadInput(f"submit: the API server refused {kind}/{name} ({e.status}): {msg}") from None
            if e.status in (401, 403):
                raise EagleJobsError(f"submit: not allowed to apply {kind}/{name} in {ns} ({msg}): "
                                     "bind the submitter Role of k8s/cluster-setup") from None
            raise
        done.append(f"{kind}/{name}")
    return done


def _status_message(e) -> str:
    """The Status body's message, on one line (an errors.Join from a webhook spans several)."""
    try:
        msg = json.loads(e.body).get("message", e.reason)
    except (TypeError, ValueError):
        msg = e.reason
    return "; ".join(line.strip() for line in str(msg).splitlines() if line.strip())


def _apply_one(core, apps, rbac, custom, net, kind, name, ns, d, kw):
    appliers = {  # kind -> the typed client's patch call (content type: apply)
        "Namespace": lambda: core.patch_namespace(name, d, **kw),
        "ServiceAccount": lambda: core.patch_namespaced_service_account(name, ns, d, **kw),
        "ConfigMap": lambda: core.patch_namespaced_config_map(name, ns, d, **kw),
        "Service": lambda: core.patch_namespaced_service(name, ns, d, **kw),
        "Deployment": lambda: apps.patch_namespaced_deployment(name, ns, d, **kw),
        "Role": lambda: rbac.patch_namespaced_role(name, ns, d, **kw),
        "RoleBinding": lambda: rbac.patch_namespaced_role_binding(name, ns, d, **kw),
        "NetworkPolicy": lambda: net.patch_namespaced_network_policy(name, ns, d, **kw),
        "JobSet": lambda: custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, d, **kw),
    }
    if kind not in appliers:
        raise BadInput(f"submit: don't know how to apply {kind}")
    appliers[kind]()


PER_RUN = ("ConfigMap", "JobSet")  # what submit applies; everything else is k8s/cluster-setup's


def submit(overlay: Path, run_id: str, recipe_path: Path | None = None, kubeconfig: str | None = None,
           images: dict[str, str] | None = None) -> dict:
    """Apply one run's objects. Shared objects (the namespace, ServiceAccounts, RBAC, the NetworkPolicy)
    belong to k8s/cluster-setup, applied once by an admin: submit never applies or relabels them, so it
    never conflicts with the admin's field manager, and only checks that they are there."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    docs = render(overlay, run_id, recipe_path, images)
    shared = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] not in PER_RUN]
    docs = [d for d in docs if d["kind"] in PER_RUN]
    js = next(d for d in docs if d["kind"] == "JobSet")
    ns = js["metadata"]["namespace"]
    api = api_client(kubeconfig)
    sa = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"].get("serviceAccountName")
    if sa:
        try:
            client.CoreV1Api(api).read_namespaced_service_account(sa, ns)
        except ApiException as e:
            if e.status == 404:
                raise BadInput(f"submit: namespace {ns} has no ServiceAccount {sa}: an admin applies the shared "
                               f"objects once: kubectl apply -k k8s/cluster-setup") from None
            if e.status not in (401, 403):
                raise
    applied = apply(api, docs)
    own_configmaps(api, docs, js)
    if shared:
        console.print(f"  not applied (shared, k8s/cluster-setup's): {', '.join(shared)}")
    console.print(f"submitted {js['metadata']['name']} in namespace {ns}: {', '.join(applied)}")
    return {"jobset": js["metadata"]["name"], "namespace": ns, "applied": applied}


def own_configmaps(api, docs: list[dict], js: dict) -> None:
    """The run's ConfigMaps, applied before the JobSet (its pods read them), then given the JobSet as owner
    (its uid exists only now; the client returns no body for apply's 201 Created, so it is read back): the
    garbage collector deletes them with it, at its TTL or on delete."""
    md = js["metadata"]
    live = read_jobset(api, md["namespace"], md["name"])
    owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "JobSet", "name": md["name"], "uid": live["metadata"]["uid"]}
    apply(api, [{**d, "metadata": {**d["metadata"], "ownerReferences": [owner]}}
                for d in docs if d["kind"] == "ConfigMap"])


def read_jobset(api, namespace: str, name: str) -> dict:
    """The JobSet as the API server returns it: its JSON object (the client types a custom object as `object`)."""
    from kubernetes import client

    return cast(dict, client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                                                name))


# -- status ------------------------------------------------------------------------------
def _cond(obj: dict, type_: str) -> dict | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


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
    if _cond(js, "Completed"):
        state = "Completed"
    elif _cond(js, "Failed"):
        state = "Failed"
    elif _cond(js, "Suspended"):
        state = "Suspended"
    for stage, pods in pod_states(api, namespace, name).items():
        if stage in stages:
            stages[stage]["pods"] = pods
    return {"jobset": name, "state": state, "stages": stages,
            "resource_version": js["metadata"].get("resourceVersion")}


def _age(ts) -> str:
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
            # the worker's code; or prepare's, when it failed and the worker never ran
            if term is not None and (cs.name == "worker" or (cs.name == "prepare" and term.exit_code)):
                return phase, f"{cs.name} exit {term.exit_code}" + (f" ({term.reason})" if term.reason else "")
        return phase, st.reason or ""
    for c in (st.conditions or []):
        if c.type == "PodScheduled" and c.status == "False":
            return phase, f"{c.reason or 'Unschedulable'}: {c.message or ''}".strip()
    sidecars = {c.name for c in (p.spec.init_containers or []) if getattr(c, "restart_policy", None) == "Always"}
    for cs in (st.init_container_statuses or []):
        w = cs.state.waiting if cs.state else None
        term = cs.state.terminated if cs.state else None
        run = cs.state.running if cs.state else None
        if w is not None and w.reason not in (None, "PodInitializing"):
            return phase, f"Init:{w.reason} ({cs.name}" + (f": {w.message}" if w.message else "") + \
                f"; {cs.restart_count} restarts)"
        if term is not None and term.exit_code:
            return phase, f"Init:Error ({cs.name} exit {term.exit_code})"
        if run is not None and cs.name in sidecars and not cs.started:
            return phase, f"Init:{cs.name} starting for {_age(run.started_at)} (not ready yet: loading the model)"
        if run is not None and cs.name not in sidecars:
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


def _name(obj: V1Pod) -> str:
    """A listed pod's name: always set (the client's OpenAPI models type every field Optional)."""
    return obj.metadata.name if obj.metadata and obj.metadata.name else ""


def pod_states(api, namespace: str, jobset: str) -> dict[str, list[dict]]:
    """Per stage, each pod's name, phase and why."""
    from kubernetes import client

    out: dict[str, list[dict]] = {}
    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={jobset}").items
    for p in sorted(pods, key=_name):
        stage = ((p.metadata.labels if p.metadata else None) or {}).get("jobset.sigs.k8s.io/replicatedjob-name", "?")
        phase, why = pod_state(p)
        out.setdefault(stage, []).append({"name": _name(p), "phase": phase, "why": why})
    return out


def store_progress(store, run_id: str) -> dict:
    from eagle_jobs.store import Stage

    out = {}
    for s in STAGES:
        st = Stage(store, run_id, StageName(s).dir)
        out[s] = {"committed_shards": len(st.store.list(st.key("manifests"))), "complete": st.is_complete()}
    return out


# the codes podFailurePolicy fails a run on at once (k8s/base/pipeline.yaml), in the containers it reads
FAIL_FAST = {int(ExitCode.USAGE): WatchExit.BAD_INPUT, int(ExitCode.BAD_INPUT): WatchExit.BAD_INPUT,
             int(ExitCode.STORE): WatchExit.STORE}
FAILING_CONTAINERS = ("worker", "prepare")


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
    for p in sorted(core.list_namespaced_pod(namespace, label_selector=sel).items, key=_name):
        name = _name(p)
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
