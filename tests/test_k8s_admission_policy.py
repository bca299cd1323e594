"""Least privilege for the verifier's remote code, on the render.

The vLLM sidecars get no read-write store credentials: eagle-jobs-store-readonly where the weights
stream from the store, none where they come from the image (dev) or a claim (weights-volume). And
k8s/cluster-setup's ValidatingAdmissionPolicy holds every JobSet of the namespace to that, to the
project's images (by digest where the namespace asks for it) and to the workers' ServiceAccount:
its CEL expressions are evaluated here by cel-python (a Common Expression Language implementation)
on every overlay's render and on renders that break each rule, as the API server evaluates them
(`object` the JobSet, `namespaceObject` its Namespace, `variables.<name>` in order: Kubernetes'
ValidatingAdmissionPolicy docs, "Variable composition").
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from conftest import kustomize

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ["dev", "smoke", "full", "full-multinode", "full-b200", "full-gb200", "qwen3-8b-1gpu"]
NS = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "eagle-jobs", "labels": {
    "kubernetes.io/metadata.name": "eagle-jobs", "pod-security.kubernetes.io/enforce": "restricted"}}}
DIGEST = "@sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def jobsets() -> dict[str, dict]:
    return {o: next(d for d in kustomize(REPO / "k8s/overlays" / o) if d["kind"] == "JobSet") for o in OVERLAYS}


@pytest.fixture(scope="module")
def policy():
    """(policy, binding) of k8s/cluster-setup, and the policy's expressions compiled by cel-python."""
    import celpy

    docs = kustomize(REPO / "k8s/cluster-setup")
    (vap,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    env = celpy.Environment()
    compiled = {
        "variables": [(v["name"], env.program(env.compile(v["expression"]))) for v in vap["spec"]["variables"]],
        "validations": [(env.program(env.compile(v["expression"])), env.program(env.compile(v["messageExpression"])))
                        for v in vap["spec"]["validations"]],
    }
    return vap, binding, compiled


def admit(policy, js: dict, namespace: dict = NS) -> list[str]:
    """The messages of the validations `js` fails, as the API server would deny its create (empty: admitted)."""
    import celpy
    from celpy import json_to_cel

    _vap, _binding, compiled = policy
    activation = {"object": json_to_cel(js), "namespaceObject": json_to_cel(namespace)}
    variables = {}
    for name, prog in compiled["variables"]:
        variables[celpy.celtypes.StringType(name)] = prog.evaluate(
            {**activation, "variables": celpy.celtypes.MapType(variables)})
    activation["variables"] = celpy.celtypes.MapType(variables)
    out = []
    for check, message in compiled["validations"]:
        result = check.evaluate(activation)
        assert isinstance(result, celpy.celtypes.BoolType), result  # an evaluation error is not a verdict
        if not result:
            out.append(str(message.evaluate(activation)))
    return out


def _sidecars(js: dict):
    for rj in js["spec"]["replicatedJobs"]:
        for c in rj["template"]["spec"]["template"]["spec"].get("initContainers", []):
            yield rj["name"], c


def _secrets(c: dict) -> set[str]:
    return ({e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
            | {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
               if "secretKeyRef" in e.get("valueFrom", {})})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_vllm_sidecar_reads_the_weights_at_most(jobsets, overlay):
    js = jobsets[overlay]
    seen = 0
    for stage, c in _sidecars(js):
        if c["name"] == "vllm":
            seen += 1
            # dev serves the image's own verifier: no store at all; the GPU overlays stream the mirror
            assert _secrets(c) == (set() if overlay == "dev" else {"eagle-jobs-store-readonly"}), (stage, c["envFrom"])
        elif c["name"] == "prepare":  # eagle-jobs' own code: checks the store, downloads the draft
            assert _secrets(c) == {"eagle-jobs-store"}
    assert seen == 3


def test_with_the_weights_volume_the_sidecar_gets_no_secret(tmp_path):
    ovl = tmp_path / "overlay"
    ovl.mkdir()
    rel = os.path.relpath(REPO / "k8s", ovl)
    (ovl / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [f"{rel}/base"],
        "components": [f"{rel}/components/{c}" for c in ("blackwell-8gpu", "vllm-sidecar", "weights-volume")]}))
    js = next(d for d in kustomize(ovl) if d["kind"] == "JobSet")
    assert {s for _stage, c in _sidecars(js) if c["name"] == "vllm" for s in _secrets(c)} == set()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_admission_policy_admits_every_render_and_by_digest_what_ci_submits(policy, jobsets, overlay):
    from eagle_jobs.cluster import pin_images

    js = jobsets[overlay]
    assert admit(policy, js) == []
    ci = {**NS, "metadata": {**NS["metadata"],
                             "labels": {**NS["metadata"]["labels"], "eagle-jobs/require-digest": "true"}}}
    by_tag = admit(policy, js, ci)
    assert len(by_tag) == 1 and "by digest" in by_tag[0] and js["metadata"]["name"] in by_tag[0]
    if overlay != "dev":  # CI submits a GPU overlay with every image pinned (cluster.pin_images)
        (pinned,) = pin_images([js], {s: f"ghcr.io/eagle-jobs/{s}{DIGEST}" for s in ("capture", "extract", "train")})
        assert admit(policy, pinned, ci) == []


def _break(js: dict, how: str) -> dict:
    bad = copy.deepcopy(js)
    capture = next(rj for rj in bad["spec"]["replicatedJobs"]
                   if rj["name"] == "capture")["template"]["spec"]["template"]["spec"]
    vllm = next(c for c in capture["initContainers"] if c["name"] == "vllm")
    if how == "another image":
        capture["containers"][0]["image"] = "docker.io/someone/exfiltrate:1"
    elif how == "a look-alike image":
        vllm["image"] = "ghcr.io/eagle-jobs/capture-evil:0.1.0"
    elif how == "another service account":
        capture["serviceAccountName"] = "default"
    elif how == "an API token":
        capture["automountServiceAccountToken"] = True
    elif how == "a secret volume":
        capture["volumes"].append({"name": "s", "secret": {"secretName": "eagle-jobs-store"}})
    elif how == "the read-write secret in the sidecar":
        vllm["envFrom"].append({"secretRef": {"name": "eagle-jobs-store"}})
    elif how == "python3 -c as the command":
        capture["containers"][0]["command"] = ["python3", "-c", "import os; print(os.environ)"]
    elif how == "another sub-command":
        capture["containers"][0]["args"] = ["exec-vllm", "/etc/eagle-jobs/recipe.yaml"]
    elif how == "an exec probe":
        capture["containers"][0]["livenessProbe"] = {"exec": {"command": ["sh", "-c", "env > /work/x"]}}
    elif how == "a lifecycle hook":
        vllm["lifecycle"] = {"postStart": {"exec": {"command": ["sh", "-c", "env"]}}}
    elif how == "PYTHONPATH at the recipe":
        capture["containers"][0]["env"].append({"name": "PYTHONPATH", "value": "/etc/eagle-jobs"})
    elif how == "the guard's account on a worker":
        capture["serviceAccountName"] = "eagle-jobs-guard"
        capture["automountServiceAccountToken"] = True
    elif how == "a Secret in the guard":
        guard = next(rj for rj in bad["spec"]["replicatedJobs"]
                     if rj["name"] == "guard")["template"]["spec"]["template"]["spec"]
        guard["containers"][0]["envFrom"] = [{"secretRef": {"name": "eagle-jobs-store"}}]
    elif how == "one key of it":
        vllm["env"].append({"name": "AWS_SECRET_ACCESS_KEY",
                            "valueFrom": {"secretKeyRef": {"name": "eagle-jobs-store",
                                                           "key": "AWS_SECRET_ACCESS_KEY"}}})
    return bad


@pytest.mark.parametrize("how,says", [
    ("another image", "every image must be one of eagle-jobs's own"),
    ("a look-alike image", "every image must be one of eagle-jobs's own"),
    ("another service account", "ServiceAccount eagle-jobs-worker"),
    ("an API token", "automountServiceAccountToken: false"),
    ("a secret volume", "no pod mounts a Secret"),
    ("the read-write secret in the sidecar", "may read no Secret but eagle-jobs-store-readonly"),
    ("one key of it", "may read no Secret but eagle-jobs-store-readonly"),
    ("python3 -c as the command", "every container runs `eagle-jobs <its stage's sub-command>`"),
    ("another sub-command", "every container runs `eagle-jobs <its stage's sub-command>`"),
    ("an exec probe", "no other exec probe than the heartbeat"),
    ("a lifecycle hook", "no lifecycle hook"),
    ("PYTHONPATH at the recipe", "no PYTHON*/LD_* variable"),
    ("the guard's account on a worker", "but the guard (eagle-jobs-guard, no Secret)"),
    ("a Secret in the guard", "but the guard (eagle-jobs-guard, no Secret)"),
])
def test_the_admission_policy_refuses_each_way_round_it(policy, jobsets, how, says):
    for overlay in ("dev", "full"):
        denied = admit(policy, _break(jobsets[overlay], how))
        assert len(denied) == 1 and says in denied[0], (overlay, denied)


def test_the_policy_binds_to_this_namespace_only_and_denies(policy):
    vap, binding, _ = policy
    assert vap["spec"]["failurePolicy"] == "Fail"
    # a denial is 422 Invalid (the default reason), which submit prints as the API server words it
    assert all(v.get("reason", "Invalid") == "Invalid" for v in vap["spec"]["validations"])
    (rule,) = vap["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["jobset.x-k8s.io"] and rule["resources"] == ["jobsets"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    assert binding["spec"]["policyName"] == vap["metadata"]["name"] and binding["spec"]["validationActions"] == ["Deny"]
    assert (binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"]
            == {"kubernetes.io/metadata.name": "eagle-jobs"})
    # cluster-scoped: neither carries a namespace (kustomize would add one to kinds it does not know)
    assert "namespace" not in vap["metadata"] and "namespace" not in binding["metadata"]
    # the submitter may change neither: its Role has no admissionregistration and no namespaces
    for role in (d for d in kustomize(REPO / "k8s/cluster-setup") if d["kind"] == "Role"):  # submitter's, guard's
        assert not any(g in r["apiGroups"] for r in role["rules"] for g in ("admissionregistration.k8s.io", "*"))
        assert not any("namespaces" in r["resources"] for r in role["rules"])


@pytest.mark.parametrize("overlay", ["dev", "full"])
def test_a_forks_registry_is_admitted_once_the_namespace_names_it_and_only_then(policy, jobsets, overlay):
    """A fork publishes to its IMAGE_REGISTRY (release.yml); an admin names it once on the Namespace, where the
    submitter cannot: then its images are admitted, the project's are not, and a look-alike still is not."""
    js = copy.deepcopy(jobsets[overlay])
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            c["image"] = c["image"].replace("ghcr.io/eagle-jobs/", "ghcr.io/acme/")
    denied = admit(policy, js)
    assert len(denied) == 1 and "ghcr[.]io/eagle-jobs/{capture,extract,train,dev}" in denied[0]
    fork = {**NS, "metadata": {**NS["metadata"], "annotations": {"eagle-jobs/image-registry": "ghcr[.]io/acme"}}}
    assert admit(policy, js, fork) == []
    assert len(admit(policy, jobsets[overlay], fork)) == 1
    evil = copy.deepcopy(js)
    evil["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["image"] = \
        "ghcr.io/acme/capture/../evil:1"
    assert len(admit(policy, evil, fork)) == 1
