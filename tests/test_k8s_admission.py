"""What a real cluster admits, deploys and keeps, beyond our own reading of the manifests.

Every overlay render against the CRD and the validating webhook of the oldest and newest JobSet we
support (tests/jobset_admission.py, ported from the sources at each tag), what `submit` says when the
API server refuses, the images a release publishes, what skaffold deploys, and the smaller rules of
issue 20 (owners, monitoring labels, sizes, GPU visibility, Kueue). Each rule cites its source.
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import jobset_admission as adm
import pytest
import yaml
from conftest import OVERLAYS
from k8s_helpers import _jobset, _pod, _pod_specs, _render_overlay

REPO = Path(__file__).resolve().parents[1]
OPS = REPO / "docs/OPERATIONS.md"


# -- 1. admitted by the real webhook on every JobSet version we support ---------------------------------------
def _check_vendored_crds():
    """tests/schemas/README.md names tag, commit and sha256 of each CRD; the files are those bytes."""
    rows = re.findall(r"^\| `(jobset\.x-k8s\.io_jobsets\.(v[\d.]+)\.yaml)` \| (v[\d.]+) \| "
                      r"([0-9a-f]{40}) \| ([0-9a-f]{64}) \|$",
                      (REPO / "tests/schemas/README.md").read_text(), re.M)
    assert {r[1] for r in rows} == set(adm.VERSIONS)
    for name, version, tag, _commit, sha in rows:
        assert version == tag and hashlib.sha256((REPO / "tests/schemas" / name).read_bytes()).hexdigest() == sha


def _variants(rendered, tmp_path) -> dict[str, dict]:
    """Every overlay, and the full run with the optional components an operator may add."""
    out = {o: _jobset(rendered[o]) for o in OVERLAYS}
    for comp in ("kueue",):
        if (REPO / "k8s/components" / comp / "kustomization.yaml").is_file():
            sub = tmp_path / comp
            sub.mkdir()
            docs = _render_overlay(sub, {"resources": ["overlays/full"], "components": [f"components/{comp}"]})
            out[f"full+{comp}"] = _jobset(docs)
    return out


def test_every_render_passes_both_crd_schemas_strictly(rendered, tmp_path):
    """Strict: a field the older CRD does not know would be pruned silently by the API server."""
    _check_vendored_crds()
    for name, js in _variants(rendered, tmp_path).items():
        for version in adm.VERSIONS:
            assert adm.schema_errors(js, version, strict=True) == [], (name, version)


@pytest.mark.parametrize("version", adm.VERSIONS)
def test_every_render_is_admitted_by_the_webhook_with_no_feature_gate(rendered, version, tmp_path):
    for name, js in _variants(rendered, tmp_path).items():
        assert adm.create_status(js, version) is None, (name, version)
        actions = {r["action"] for r in js["spec"]["failurePolicy"]["rules"]}
        assert actions <= {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}, name


def _with_restart_job(js: dict) -> dict:
    bad = copy.deepcopy(js)
    bad["spec"]["failurePolicy"]["rules"][-1]["action"] = "RestartJob"
    return bad


def test_the_stand_in_refuses_what_each_version_refuses(rendered):
    """RestartJob: not in v0.8.2's enum (422 from the schema); v0.12.0's webhook refuses it with the gate off
    (422 Invalid, wrapped) and admits it with the gate on; a name too long and a forward dependsOn too."""
    js = _jobset(rendered["full"])
    name = js["metadata"]["name"]
    bad = _with_restart_job(js)
    i = len(bad["spec"]["failurePolicy"]["rules"]) - 1
    assert adm.create_status(bad, adm.OLDEST) == adm.status(422, "Invalid", (
        f'JobSet.jobset.x-k8s.io "{name}" is invalid: spec.failurePolicy.rules[{i}].action: Unsupported value: '
        '"RestartJob": supported values: "FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"'))
    new = adm.create_status(bad, adm.NEWEST)
    assert new == adm.status(422, "Invalid",
                             'admission webhook "vjobset.kb.io" denied the request: JobSet.jobset.x-k8s.io '
                             f'"{name}" is invalid: <nil>: Internal error: '
                             'RestartJob and RestartJobAndIgnoreMaxRestarts '
                             'failure policy actions are not allowed when RestartJob feature gate is disabled')
    assert adm.create_status(bad, adm.NEWEST, gates=frozenset({"RestartJob"})) is None
    long = copy.deepcopy(js)
    long["metadata"]["name"] = "e" * 50
    for version in adm.VERSIONS:
        st = adm.create_status(long, version)
        assert "pod names generated for this JobSet will exceed 63 characters" in st["message"], version
    assert adm.create_status(long, adm.OLDEST)["code"] == 403  # v0.8.2's errors.Join: controller-runtime's Denied
    forward = copy.deepcopy(js)
    rjobs = forward["spec"]["replicatedJobs"]
    rjobs.append(rjobs.pop(1))  # capture moved last: extract now depends on a later replicatedJob
    assert ("replicatedJob: extract cannot depend on replicatedJob: capture"
            in adm.create_status(forward, adm.NEWEST)["message"])


@pytest.mark.parametrize("version", adm.VERSIONS)
def test_submit_shows_the_api_servers_own_refusal(kube, tmp_path, version):
    """The fake API server answers as the real one does where JobSet `version` is installed (422 or 403 Status
    bodies); submit prints that Status's message on one line, nothing of its own about the cause."""
    from eagle_jobs import cluster
    from eagle_jobs.errors import BadInput

    fake, kc = kube
    fake.admit = adm.admit(version)
    patch = [{"op": "replace", "path": "/spec/failurePolicy/rules/1/action", "value": "RestartJob"}]
    _render_overlay(tmp_path, {"resources": ["overlays/smoke"], "patches": [
        {"target": {"group": "jobset.x-k8s.io", "kind": "JobSet"}, "patch": yaml.safe_dump(patch)}]})
    with pytest.raises(BadInput) as err:
        cluster.submit(tmp_path / "overlay", "r1", kubeconfig=kc)
    js = next(d for d in cluster.render(tmp_path / "overlay", "r1") if d["kind"] == "JobSet")
    refusal = adm.create_status(js, version)
    assert refusal["code"] in (403, 422) and "RestartJob" in refusal["message"]
    assert str(err.value) == (f"submit: the API server refused JobSet/eagle-jobs-r1 ({refusal['code']}): "
                              + refusal["message"].replace("\n", "; "))
    assert "\n" not in str(err.value) and "different spec" not in str(err.value)
    assert fake.get("/apis/jobset.x-k8s.io/v1alpha2/namespaces/eagle-jobs/jobsets", "eagle-jobs-r1") is None
    # the shipped overlay goes through the same API server
    assert cluster.submit(REPO / "k8s/overlays/smoke", "r2", kubeconfig=kc)["jobset"] == "eagle-jobs-r2"


FEATURE_ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \| (JobSet|Kubernetes) (v?[\d.]+)[^|]* \| ([^|]+) \|$", re.M)


def _schema_has(schema: dict, path: str) -> bool:
    """`spec.replicatedJobs[].dependsOn` in the CRD schema (a value after `=`: one of the field's enum)."""
    path, _, value = path.partition("=")
    node = schema
    for part in path.split("."):
        node = node.get("properties", {}).get(part.removesuffix("[]"))
        if node is None:
            return False
        node = node.get("items", {}) if part.endswith("[]") else node
    return not value or value in node.get("enum", [])


def _jobset_fields(js: dict) -> set[str]:
    """The JobSet fields a render sets, as the table spells them."""
    spec = js["spec"]
    out = {f"spec.{k}" for k in spec if k != "replicatedJobs"}
    out |= {f"spec.replicatedJobs[].{k}" for rj in spec["replicatedJobs"] for k in rj if k not in ("name", "template")}
    for key in ("failurePolicy", "successPolicy", "network"):
        out |= {f"spec.{key}.{k}" for k in spec.get(key) or {}}
    for rule in (spec.get("failurePolicy") or {}).get("rules", []):
        out |= {f"spec.failurePolicy.rules[].{k}" for k in rule if k != "action"}
        out.add(f"spec.failurePolicy.rules[].action={rule['action']}")
    return out


def test_operations_table_names_every_jobset_feature_the_renders_use(rendered, tmp_path):
    """docs/OPERATIONS.md#what-the-cluster-must-admit: one row per JobSet field we set (and per failure-policy
    action), the version that admits it, its source. The oldest CRD we support has each of them; the gated
    RestartJob is not in it."""
    rows = {m[0]: m for m in FEATURE_ROW.findall(OPS.read_text())}
    used = set().union(*(_jobset_fields(js) for js in _variants(rendered, tmp_path).values()))
    assert used <= set(rows), sorted(used - set(rows))
    oldest = adm.schema(adm.OLDEST)
    for field, row in rows.items():
        if row[2] == "JobSet" and "not used" not in row[1]:
            assert _schema_has(oldest, field), field
            assert tuple(map(int, row[3].lstrip("v").split("."))) <= (0, 8, 2), field
    gated = rows["spec.failurePolicy.rules[].action=RestartJob"]
    assert "not used" in gated[1] and gated[3] == adm.NEWEST and gated[0] not in used
    assert not _schema_has(oldest, "spec.failurePolicy.rules[].action=RestartJob")
    assert _schema_has(adm.schema(adm.NEWEST), "spec.failurePolicy.rules[].action=RestartJob")
    k8s = {f: r for f, r in rows.items() if r[2] == "Kubernetes"}
    assert {"backoffLimitPerIndex", "podFailurePolicy", "podReplacementPolicy",
            "initContainers[].restartPolicy=Always"} <= set(k8s)
    assert all(tuple(map(int, r[3].split("."))) <= (1, 33) for r in k8s.values())  # the oldest Kubernetes we test


# -- 2. one image naming scheme, end to end ----------------------------------------------------------------------
RELEASE, RETRAIN = REPO / ".github/workflows/release.yml", REPO / ".github/workflows/retrain.yml"
THIRD_PARTY = {"quay.io/minio/mc"}  # dev only (components/minio), pinned by release tag
REGISTRY_EXPR = re.compile(r"\$\{\{ vars\.IMAGE_REGISTRY \|\| '([^']+)' \}\}")


def _published() -> tuple[str, list[str]]:
    """(registry, image names) that release.yml pushes."""
    wf = yaml.safe_load(RELEASE.read_text())
    return (REGISTRY_EXPR.fullmatch(wf["env"]["REGISTRY"])[1],
            [e["image"] for e in wf["jobs"]["images"]["strategy"]["matrix"]["include"]])


def _images(docs: list[dict]) -> list[str]:
    return [c["image"] for d in docs for pod in _pod_specs(d)
            for c in pod.get("containers", []) + pod.get("initContainers", [])]


def test_release_publishes_every_image_the_manifests_name_and_ci_uses_the_same_names(rendered, tmp_path):
    import shutil
    import subprocess
    import sys
    import tomllib

    from eagle_jobs import cluster

    registry, published = _published()
    assert registry == "ghcr.io/eagle-jobs" and set(published) == {"capture", "extract", "train", "dev"}
    wf = yaml.safe_load(RELEASE.read_text())
    assert "v*" in (wf[True] if True in wf else wf["on"])["push"]["tags"]
    steps = {s.get("id"): s for s in wf["jobs"]["images"]["steps"]}
    assert steps["build"]["with"] == {"context": ".", "file": "images/${{ matrix.image }}/Dockerfile", "push": True,
                                      "platforms": "${{ matrix.platforms }}",
                                      "tags": "${{ env.REGISTRY }}/${{ matrix.image }}"
                                              ":${{ steps.version.outputs.version }}"}
    assert "pyproject.toml" in steps["version"]["run"] and "exit 1" in steps["version"]["run"]  # tag == version
    assert "${{ steps.build.outputs.digest }}" in RELEASE.read_text()  # each digest recorded
    assert all((REPO / "images" / p / "Dockerfile").is_file() for p in published)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    names = {f"{registry}/{p}" for p in published}
    for overlay, docs in rendered.items():
        for image in _images(docs):
            name, _, tag = image.partition(":")
            assert (name in names and tag == version) or name in THIRD_PARTY, (overlay, image)
    assert set(cluster.IMAGE_NAMES.values()) <= names  # what `submit --image` pins
    rt = yaml.safe_load(RETRAIN.read_text())  # CI's retraining path: the same names, tagged by commit
    assert REGISTRY_EXPR.fullmatch(rt["env"]["REGISTRY"])[1] == registry
    built = {s["id"]: s["with"]["tags"] for s in rt["jobs"]["images"]["steps"] if s.get("id")}
    assert built == {p: f"${{{{ env.REGISTRY }}}}/{p}:${{{{ github.sha }}}}" for p in ("capture", "extract", "train")}
    for p in built:
        assert rt["jobs"]["submit"]["env"][f"{p.upper()}_IMAGE"].startswith(f"{rt['env']['REGISTRY']}/{p}@")
    exe = shutil.which("actionlint") or str(Path(sys.executable).with_name("actionlint"))
    r = subprocess.run([exe, str(RELEASE), str(RETRAIN)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_moves_every_image_to_another_registry(overlay, tmp_path):
    """kustomize `images:` in one more overlay reaches every container, components' included."""
    registry, published = _published()
    mirror = "registry.example.com/mirror"
    images = [{"name": f"{registry}/{p}", "newName": f"{mirror}/{p}"} for p in published]
    images += [{"name": n, "newName": f"{mirror}/{n.split('/', 1)[1]}"} for n in sorted(THIRD_PARTY)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = _images(_render_overlay(tmp_path / "a", {"resources": [f"overlays/{overlay}"]}))
    after = _images(_render_overlay(tmp_path / "b", {"resources": [f"overlays/{overlay}"], "images": images}))
    assert len(after) == len(before) >= 4
    assert [i for i in after if not i.startswith(f"{mirror}/")] == [], overlay


def test_pull_secret_component_gives_every_pod_the_registry_credentials(rendered, tmp_path):
    """components/pull-secret on k8s/cluster-setup: the workers' ServiceAccount names the pull secret; the
    ServiceAccount admission plugin copies it into every pod that names none itself (kubernetes
    plugin/pkg/admission/serviceaccount/admission.go, Admit: `if len(pod.Spec.ImagePullSecrets) == 0`)."""
    import subprocess
    import sys

    docs = _render_overlay(tmp_path, {"resources": ["cluster-setup"], "components": ["components/pull-secret"]})
    sas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    for name in ("eagle-jobs-worker", "eagle-jobs-guard"):
        assert sas[name]["imagePullSecrets"] == [{"name": "eagle-jobs-pull"}], name
    f = tmp_path / "setup.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "-k", "1.33.0", str(f)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    for overlay in OVERLAYS:
        js = _jobset(rendered[overlay])
        for rj in js["spec"]["replicatedJobs"]:
            pod = _pod(js, rj["name"])
            assert ("imagePullSecrets" in sas[pod["serviceAccountName"]]
                    and "imagePullSecrets" not in pod), (overlay, rj["name"])
    assert "components/pull-secret" in OPS.read_text() and "eagle-jobs-pull" in OPS.read_text()


# -- 3. skaffold dev deploys what it built ------------------------------------------------------------------------
SKAFFOLD = REPO / "skaffold.yaml"


def _skaffold() -> dict:
    (cfg,) = [d for d in yaml.safe_load_all(SKAFFOLD.read_text()) if d]
    return cfg


def _skaffold_dev(docs: list[dict], built: str, run_id: str, resource_selector: dict | None) -> list[dict]:
    """The dev render as `skaffold dev -p dev` applies it, having built images/dev as `built`."""
    import skaffold_transform

    (artifact,) = next(p for p in _skaffold()["profiles"] if p["name"] == "dev")["patches"][0]["value"]
    return skaffold_transform.transform(docs, {artifact["image"]: built}, {"skaffold.dev/run-id": run_id},
                                        resource_selector)


def test_skaffold_dev_deploys_the_image_it_built_in_every_container(rendered):
    """skaffold.yaml validates against skaffold's own schema for its apiVersion (tests/schemas/skaffold-v4beta11.json,
    docs-v2/content/en/schemas at v2.24.0) and allows JobSet in its resourceSelector; the dev render as skaffold
    transforms it then names the built tag in every container and carries skaffold's run label on every
    pod template (log streaming). Without the selector skaffold leaves the JobSet alone."""
    import json

    import jsonschema

    cfg = _skaffold()
    assert cfg["apiVersion"] == "skaffold/v4beta11"
    jsonschema.validate(cfg, json.loads((REPO / "tests/schemas/skaffold-v4beta11.json").read_text()))
    built = "ghcr.io/eagle-jobs/dev:5f3c2e1-dirty"
    docs = _skaffold_dev(rendered["dev"], built, "run-1", cfg.get("resourceSelector"))
    ours = [i for i in _images(docs) if i.partition(":")[0] not in THIRD_PARTY]  # mc: pinned, never built
    assert set(ours) == {built} and len(ours) >= 10
    js = _jobset(docs)
    assert js["metadata"]["labels"]["skaffold.dev/run-id"] == "run-1"
    for rj in js["spec"]["replicatedJobs"]:
        assert rj["template"]["spec"]["template"]["metadata"]["labels"]["skaffold.dev/run-id"] == "run-1"
        assert rj["template"]["spec"]["template"]["metadata"]["labels"]["eagle-jobs/stage"] == rj["name"]
    untouched = _skaffold_dev(rendered["dev"], built, "run-1", None)
    assert built not in _images(untouched) and _images(untouched) == _images(rendered["dev"])


def test_a_skaffold_redeploy_recreates_the_jobset_from_jobset_v0_12(rendered):
    """A rebuild changes the JobSet's pod templates, which are immutable. `kubectl apply --force` deletes and
    recreates only on 409 Conflict or 422 Invalid (kubectl pkg/cmd/apply/patcher.go, Patcher.Patch:
    `(apierrors.IsConflict(err) || apierrors.IsInvalid(err)) && p.Force` -> deleteAndCreate). JobSet v0.12.0's
    webhook refuses the update with 422; v0.8.2's with 403, and every redeploy would fail: the dev docs pin v0.12.0."""
    cfg = _skaffold()
    assert "--force" in cfg["deploy"]["kubectl"]["flags"]["apply"]
    first = _jobset(_skaffold_dev(rendered["dev"], "ghcr.io/eagle-jobs/dev:aaaaaaa", "run-1", cfg["resourceSelector"]))
    second = _jobset(_skaffold_dev(rendered["dev"], "ghcr.io/eagle-jobs/dev:bbbbbbb", "run-2", cfg["resourceSelector"]))
    recreated = {v: (adm.update_status(first, second, v) or {}).get("reason") in ("Conflict", "Invalid")
                 for v in adm.VERSIONS}
    assert recreated == {adm.OLDEST: False, adm.NEWEST: True}
    assert adm.update_status(first, first, adm.NEWEST) is None
    dev = OPS.read_text().split("### Dev loop")[1].split("\n## ")[0]
    assert "jobset/releases/download/v0.12.0/manifests.yaml" in dev and "403" in dev


# kind's node beside the dev pods: kubeadm's static pods (cmd/kubeadm/app/phases/controlplane/manifests.go
# GetStaticPodSpecs: kube-apiserver 250m, kube-controller-manager 200m, kube-scheduler 100m; phases/etcd/local.go:
# etcd 100m), CoreDNS 2 x 100m (phases/addons/dns manifests), kindnet 100m (kind's CNI manifest); the JobSet
# controller (jobset config/components/manager/manager.yaml at v0.12.0, line 95: cpu 500m, memory 128Mi)
DEV_NODE_CPU = 4.0
KIND_CONTROL_PLANE_CPU = 0.25 + 0.2 + 0.1 + 0.1 + 2 * 0.1 + 0.1
JOBSET_CONTROLLER_CPU = 0.5


def _cpu(q) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def pod_cpu_request(pod: dict) -> float:
    """The scheduler's view of a pod's CPU request with native sidecars (kubernetes pkg/api/v1/resource/helpers.go
    PodRequests -> AggregateContainerRequests): the larger of (app containers + every sidecar) and, for each
    init container in order, its own request plus the sidecars started before it."""
    req = lambda c: _cpu(c.get("resources", {}).get("requests", {}).get("cpu", 0))  # noqa: E731
    sidecars, peak = 0.0, 0.0
    for c in pod.get("initContainers", []):
        peak = max(peak, sidecars + req(c))
        if c.get("restartPolicy") == "Always":
            sidecars += req(c)
    return max(peak, sidecars + sum(req(c) for c in pod["containers"]))


def test_dev_pods_fit_a_4_cpu_kind_node_with_its_controllers(rendered, shared_rendered):
    (minio,) = [d for d in shared_rendered["dev-services"] if d["kind"] == "Deployment"]
    free = (DEV_NODE_CPU - KIND_CONTROL_PLANE_CPU - JOBSET_CONTROLLER_CPU
            - pod_cpu_request(minio["spec"]["template"]["spec"]))
    assert abs(free - 2.05) < 1e-9
    js = _jobset(rendered["dev"])
    for rj in js["spec"]["replicatedJobs"]:  # one stage at a time (dependsOn): each pod alone must fit
        assert pod_cpu_request(_pod(js, rj["name"])) <= free, rj["name"]
    shm = [v for v in _pod(js, "train")["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in _pod(js, "train")["containers"][0]["volumeMounts"]


# -- 9. the smaller items ------------------------------------------------------------------------------------------
JS_COLL = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/eagle-jobs/jobsets"


def garbage_collect(fake) -> list[tuple[str, str]]:
    """kube-controller-manager's garbage collector as it treats our objects (pkg/controller/garbagecollector,
    attemptToDeleteItem): an object all of whose owners are gone (no object with the referenced uid) is
    deleted; blockOwnerDeletion and foreground deletion are not used here."""
    uids = {o["metadata"]["uid"] for o in fake.objects.values()}
    gone = [key for key, o in fake.objects.items()
            if o["metadata"].get("ownerReferences")
            and not any(r["uid"] in uids for r in o["metadata"]["ownerReferences"])]
    for coll, name in gone:
        fake.delete(coll, name)
    return gone


def test_submit_makes_the_jobset_own_its_configmaps(kube):
    from eagle_jobs import cluster

    fake, kc = kube
    for run in ("r1", "r2", "r1"):  # the second r1: idempotent, still one owner
        cluster.submit(REPO / "k8s/overlays/smoke", run, kubeconfig=kc)
        # one run of a recipe at a time (cluster.apply.check_no_other_run): this one ends before the next
        fake.set_status(JS_COLL, f"eagle-jobs-{run}", {"conditions": [{"type": "Completed", "status": "True"}]})
    for run in ("r1", "r2"):
        js = fake.get(JS_COLL, f"eagle-jobs-{run}")
        cms = [o for (c, n), o in fake.objects.items() if c.endswith("/configmaps") and f"-{run}-" in n]
        assert len(cms) == 2
        for cm in cms:
            assert cm["metadata"]["namespace"] == js["metadata"]["namespace"]  # owners are never cross-namespace
            assert cm["metadata"]["ownerReferences"] == [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                                                          "name": js["metadata"]["name"], "uid": js["metadata"]["uid"]}]
    assert garbage_collect(fake) == []
    fake.delete(JS_COLL, "eagle-jobs-r1")  # its TTL, or kubectl delete jobset
    collected = garbage_collect(fake)
    assert len(collected) == 2 and all("-r1-" in n for _c, n in collected)
    assert [n for (c, n) in fake.objects if c.endswith("/configmaps")] and not any(
        "-r1-" in n for (c, n) in fake.objects if c.endswith("/configmaps"))


def test_kube_prometheus_stack_selects_the_podmonitor(tmp_path):
    """The chart's Prometheus: podMonitorSelector {matchLabels: {release: <release name>}} when
    podMonitorSelectorNilUsesHelmValues (default true), podMonitorNamespaceSelector {} (every namespace):
    prometheus-community/helm-charts charts/kube-prometheus-stack/templates/prometheus/prometheus.yaml."""
    docs = _render_overlay(tmp_path, {"resources": ["monitoring"]})
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    selector = {"matchLabels": {"release": "kube-prometheus-stack"}}
    assert all(pm["metadata"]["labels"].get(k) == v for k, v in selector["matchLabels"].items())
    (tmp_path / "other").mkdir()
    other = _render_overlay(tmp_path / "other",
                            {"resources": ["monitoring"], "labels": [{"pairs": {"release": "prom"}}]})
    # as documented
    assert next(d for d in other if d["kind"] == "PodMonitor")["metadata"]["labels"]["release"] == "prom"
    assert "release: kube-prometheus-stack" in OPS.read_text()


def test_smoke_trains_on_one_gpu_with_an_eighth_of_the_node(rendered):
    full, smoke = _pod(_jobset(rendered["full"]), "train"), _pod(_jobset(rendered["smoke"]), "train")
    fr, sr = full["containers"][0]["resources"], smoke["containers"][0]["resources"]
    gpus = int(sr["limits"]["nvidia.com/gpu"])
    assert gpus == 1 and int(fr["limits"]["nvidia.com/gpu"]) == 8
    assert _cpu(sr["requests"]["cpu"]) == _cpu(fr["requests"]["cpu"]) * gpus / 8
    gib = lambda q: float(q.removesuffix("Gi"))  # noqa: E731
    assert gib(sr["requests"]["memory"]) == gib(fr["requests"]["memory"]) * gpus / 8
    assert sr["requests"] == sr["limits"]
    shm = next(v for v in smoke["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
    assert gib(shm) < gib(sr["limits"]["memory"]) / 2  # charged to the pod's memory


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "dev"])
def test_no_container_that_asks_for_no_gpu_sees_one(rendered, overlay):
    """CUDA images set NVIDIA_VISIBLE_DEVICES=all; on a toolkit that honours the variable, a container with no
    GPU request would see every GPU of the node: void hides them (prepare, the workers beside a sidecar, mirror)."""
    js = _jobset(rendered[overlay])
    for rj in js["spec"]["replicatedJobs"]:
        pod = _pod(js, rj["name"])
        for c in pod.get("initContainers", []) + pod["containers"]:
            if not c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu"):
                assert ({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
                        in c.get("env", [])), (overlay, rj["name"], c["name"])


def kueue_pods_ready(js: dict) -> bool:
    """kubernetes-sigs/kueue v0.19.2 pkg/controller/jobs/jobset/jobset_controller.go JobSet.PodsReady (185-195)."""
    replicas = sum(rj.get("replicas", 1) for rj in js["spec"]["replicatedJobs"])
    ready = sum(s.get("ready", 0) + s.get("succeeded", 0) for s in js.get("status", {}).get("replicatedJobsStatus", []))
    return replicas == ready


def test_kueue_never_sees_a_dependson_run_ready_before_its_last_stage(rendered, tmp_path):
    """Why components/kueue needs waitForPodsReady off: each stage in turn running and ready, the earlier ones
    done, the later ones not created (dependsOn), as JobSet reports them in status.replicatedJobsStatus."""
    (tmp_path / "k").mkdir()
    js = _jobset(_render_overlay(tmp_path / "k", {"resources": ["overlays/full"], "components": ["components/kueue"]}))
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "eagle-jobs"
    names = [rj["name"] for rj in js["spec"]["replicatedJobs"]]
    seen = []
    for i in range(len(names)):
        status = [{"name": n, "ready": int(k == i), "succeeded": int(k < i), "active": int(k == i)}
                  for k, n in enumerate(names)]
        seen.append(kueue_pods_ready({**js, "status": {"replicatedJobsStatus": status}}))
    assert seen == [False] * (len(names) - 1) + [True]
    comp = (REPO / "k8s/components/kueue/kustomization.yaml").read_text()
    assert "waitForPodsReady" in comp and "DisableWaitForPodsReady=true" in OPS.read_text()
