"""Applying a run: server-side apply of the run's ConfigMaps and JobSet (field manager eagle-jobs), the
API server's own refusal reported in one line, the ConfigMaps then owned by their JobSet."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_jobs.cluster.api import APPLY, FIELD_MANAGER, GROUP, PLURAL, VERSION, api_client, read_jobset
from eagle_jobs.cluster.render import render
from eagle_jobs.errors import BadInput, EagleJobsError
from eagle_jobs.progress import console


def apply(api, docs: list[dict]) -> list[str]:
    """Server-side apply each object (field manager eagle-jobs), in dependency order."""
    from kubernetes.client.exceptions import ApiException

    # No force: a CI submitter must not silently take over fields another manager owns.
    appliers = _appliers(api, {"field_manager": FIELD_MANAGER, "_content_type": APPLY})
    # the NetworkPolicy before the JobSet: no vLLM port is ever open without it
    order = {"Namespace": 0, "ServiceAccount": 1, "Role": 1, "RoleBinding": 2, "ConfigMap": 2, "Service": 3,
             "NetworkPolicy": 3, "Deployment": 4, "JobSet": 9}
    done = []
    for d in sorted(docs, key=lambda d: order.get(d["kind"], 5)):
        kind, md = d["kind"], d["metadata"]
        name, ns = md["name"], md.get("namespace")
        if kind not in appliers:
            raise BadInput(f"submit: don't know how to apply {kind}")
        try:
            appliers[kind](name, ns, d)
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



def _appliers(api, kw: dict) -> dict:
    """kind -> (name, namespace, object) -> the typed client's patch call with kw (content type: apply)."""
    from kubernetes import client

    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    custom, net = client.CustomObjectsApi(api), client.NetworkingV1Api(api)
    return {
        "Namespace": lambda name, ns, d: core.patch_namespace(name, d, **kw),
        "ServiceAccount": lambda name, ns, d: core.patch_namespaced_service_account(name, ns, d, **kw),
        "ConfigMap": lambda name, ns, d: core.patch_namespaced_config_map(name, ns, d, **kw),
        "Service": lambda name, ns, d: core.patch_namespaced_service(name, ns, d, **kw),
        "Deployment": lambda name, ns, d: apps.patch_namespaced_deployment(name, ns, d, **kw),
        "Role": lambda name, ns, d: rbac.patch_namespaced_role(name, ns, d, **kw),
        "RoleBinding": lambda name, ns, d: rbac.patch_namespaced_role_binding(name, ns, d, **kw),
        "NetworkPolicy": lambda name, ns, d: net.patch_namespaced_network_policy(name, ns, d, **kw),
        "JobSet": lambda name, ns, d: custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, d, **kw),
    }

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
    # every ServiceAccount the run's pods use (the workers' and the guard's): one missing would leave its
    # pods uncreated, which no pod status shows
    for sa in sorted({sa for rj in js["spec"]["replicatedJobs"]
                      if (sa := rj["template"]["spec"]["template"]["spec"].get("serviceAccountName"))}):
        try:
            client.CoreV1Api(api).read_namespaced_service_account(sa, ns)
        except ApiException as e:
            if e.status == 404:
                raise BadInput(f"submit: namespace {ns} has no ServiceAccount {sa}: an admin applies the shared "
                               f"objects once: kubectl apply -k k8s/cluster-setup") from None
            if e.status not in (401, 403):
                raise
    check_no_other_run(api, js)
    applied = apply(api, docs)
    own_configmaps(api, docs, js)
    if shared:
        console.print(f"  not applied (shared, k8s/cluster-setup's): {', '.join(shared)}")
    console.print(f"submitted {js['metadata']['name']} in namespace {ns}: {', '.join(applied)}")
    return {"jobset": js["metadata"]["name"], "namespace": ns, "applied": applied}



def check_no_other_run(api, js: dict) -> None:
    """One run of a recipe at a time: refuse (exit 11, nothing applied) while another JobSet of the same recipe
    has neither a Completed nor a Failed condition. Two runs of one recipe would book the GPUs twice for the
    same conversations (reuse takes only what the other run has committed), and the retrain schedule
    (.github/workflows/retrain.yml) fires again before the recipe's plan says a run ends. Refused rather
    than queued: a queued JobSet needs something to release it (Kueue does, where installed: docs/
    OPERATIONS.md#shared-clusters-kueue); a refused submit is retried by the next schedule or by hand."""
    from kubernetes import client

    from eagle_jobs.cluster.api import condition
    from eagle_jobs.cluster.render import RECIPE_LABEL
    from eagle_jobs.errors import Busy

    md = js["metadata"]
    recipe = (md.get("labels") or {}).get(RECIPE_LABEL)
    if not recipe:
        return
    found: dict = client.CustomObjectsApi(api).list_namespaced_custom_object(  # type: ignore[assignment]
        GROUP, VERSION, md["namespace"], PLURAL, label_selector=f"{RECIPE_LABEL}={recipe}")
    for other in found.get("items", []):
        name = other["metadata"]["name"]
        if name == md["name"] or condition(other, "Completed") or condition(other, "Failed"):
            continue
        since = other["metadata"].get("creationTimestamp", "?")
        raise Busy(f"submit: run {other['metadata'].get('labels', {}).get('eagle-jobs/run-id', name)} of recipe "
                   f"'{recipe}' is still running (JobSet {name}, created {since}): one run of a recipe at a time; "
                   f"follow it with `eagle-jobs watch`, or delete it first (kubectl -n {md['namespace']} delete "
                   f"jobset {name})")


def own_configmaps(api, docs: list[dict], js: dict) -> None:
    """The run's ConfigMaps, applied before the JobSet (its pods read them), then given the JobSet as owner
    (its uid exists only now; the client returns no body for apply's 201 Created, so it is read back): the
    garbage collector deletes them with it, at its TTL or on delete."""
    md = js["metadata"]
    live = read_jobset(api, md["namespace"], md["name"])
    owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "JobSet", "name": md["name"], "uid": live["metadata"]["uid"]}
    apply(api, [{**d, "metadata": {**d["metadata"], "ownerReferences": [owner]}}
                for d in docs if d["kind"] == "ConfigMap"])
