"""The Kubernetes manifests, validated without a cluster.

Every overlay is rendered with `kubectl kustomize`; core kinds go through
kubernetes-validate --strict against the oldest Kubernetes we support (1.33:
per-index backoff for Indexed Jobs); the JobSet against the CRD's own
openAPIV3Schema (tests/schemas, JobSet v0.12.0; v0.8.2 and both webhooks in
test_k8s_admission.py), made strict; and the
Jobs inside it as batch/v1 Jobs. Then assertions on what the objects say.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import OVERLAYS, SHARED, kustomize
from k8s_helpers import _job, _jobset, _pod, _pod_specs, _render_overlay

REPO = Path(__file__).resolve().parents[1]
OLDEST_K8S = "1.33.0"
RECIPES = {"dev": "demo-dev", "smoke": "kimi-k2.5-smoke", "full": "kimi-k2.5", "full-multinode": "kimi-k2.5",
           "qwen3-8b-1gpu": "qwen3-8b"}
STAGES = ["capture", "extract", "train", "evaluate"]
# the GPU overlays stream the verifier from the store's mirror, made by a first stage (components/verifier-mirror)
MIRRORED = {"dev": False, "smoke": True, "full": True, "full-multinode": True, "qwen3-8b-1gpu": True}


GENERATED = re.compile(r"^(eagle-jobs-(?:run|recipe))-[a-z0-9]{10}$")  # kustomize's content hash


def _configmaps(docs) -> dict[str, dict]:
    """ConfigMap data by name, and by generator name (eagle-jobs-recipe for eagle-jobs-recipe-<hash>)."""
    out = {}
    for d in docs:
        if d["kind"] == "ConfigMap":
            out[d["metadata"]["name"]] = d["data"]
            m = GENERATED.match(d["metadata"]["name"])
            if m:
                out[m[1]] = d["data"]
    return out


def _jobset_schema() -> dict:
    """The newest supported CRD's v1alpha2 schema, made strict (unknown fields rejected); every render
    meets the oldest one's too (tests/test_k8s_admission.py)."""
    import jobset_admission

    return jobset_admission.schema(jobset_admission.NEWEST, strict=True)


def _printing_vllm(tmp_path: Path) -> Path:
    """A `vllm` on PATH that prints how it was exec'd (its path, then one argument per line)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "vllm").write_text('#!/bin/sh\nprintf "%s\\n" "$0" "$@"\n')
    (bindir / "vllm").chmod(0o755)
    return bindir


def _pod_cli(container: dict, tmp_path: Path, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    """A container's `eagle-jobs` args run here, its mounts (/etc/eagle-jobs, /work) under tmp_path."""
    args = [a.replace("/etc/eagle-jobs", str(tmp_path / "etc")).replace("/work", str(tmp_path / "work"))
            for a in container["args"]]
    return subprocess.run([sys.executable, "-m", "eagle_jobs.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_kinds_validate_strictly(rendered, overlay, tmp_path):
    docs = [d for d in rendered[overlay] if d["kind"] != "JobSet"]
    # the Jobs JobSet will create, as batch/v1 Jobs: podFailurePolicy, per-index backoff, sidecars...
    for rj in _jobset(rendered[overlay])["spec"]["replicatedJobs"]:
        docs.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"x-{rj['name']}"},
                     "spec": rj["template"]["spec"]})
    f = tmp_path / "docs.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "-k", OLDEST_K8S, str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == len(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_jobset_matches_crd_schema(rendered, overlay):
    import jsonschema

    schema = _jobset_schema()
    js = _jobset(rendered[overlay])
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    jsonschema.validate(js, schema)
    bad = copy.deepcopy(js)
    bad["spec"]["replicatedJobs"][1]["dependsOn"] = [{"name": "capture", "status": "Done"}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)  # the schema is strict enough to catch a wrong enum


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pipeline_shape(rendered, overlay):
    js = _jobset(rendered[overlay])
    rjs = js["spec"]["replicatedJobs"]
    assert [r["name"] for r in rjs] == ["mirror"] * MIRRORED[overlay] + STAGES + ["guard"]
    assert rjs[0].get("dependsOn") is None and rjs[-1].get("dependsOn") is None  # the guard starts with the run
    rjs = rjs[:-1]
    # a recipe that streams (full's) trains once extraction is Ready (components/stream); else in turn
    recipe = yaml.safe_load(_configmaps(rendered[overlay])["eagle-jobs-recipe"]["recipe.yaml"])
    streams = recipe.get("train", {}).get("source") == "stream"
    for prev, r in zip(rjs, rjs[1:]):
        status = "Ready" if streams and r["name"] == "train" else "Complete"
        assert r["dependsOn"] == [{"name": prev["name"], "status": status}], (overlay, r["name"])
    assert streams == (overlay in ("full", "full-multinode"))
    assert js["spec"]["ttlSecondsAfterFinished"] > 0
    for st in STAGES:
        job = _job(js, st)
        assert job["activeDeadlineSeconds"] > 0 and job["completionMode"] == "Indexed"
        assert job["podReplacementPolicy"] == "Failed"
    ex = _job(js, "extract")
    assert ex["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in ex
    env = {e["name"]: e.get("value") for e in _pod(js, "extract")["containers"][0]["env"]}
    assert env["EAGLE_JOBS_NUM_SHARDS"] == str(ex["completions"]) == str(ex["parallelism"])
    assert ex["completions"] == (4 if overlay.startswith("full") else 1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_exit_code_mapping(rendered, overlay):
    from eagle_jobs.errors import ExitCode

    js = _jobset(rendered[overlay])
    for st in STAGES:
        rules = _job(js, st)["podFailurePolicy"]["rules"]
        by_code = {v: r["action"] for r in rules if "onExitCodes" in r for v in r["onExitCodes"]["values"]}
        assert by_code[int(ExitCode.BAD_INPUT)] == by_code[int(ExitCode.STORE)] == "FailJob"
        # first: the Job controller takes the first rule that matches (tests/test_k8s_failure.py)
        assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


GPU = {"dev": {}, "smoke": {**{s: 8 for s in STAGES}, "train": 1}, "full": {s: 8 for s in STAGES},
       "full-multinode": {s: 8 for s in STAGES}, "qwen3-8b-1gpu": {s: 1 for s in STAGES}}
# the GFD products each GPU overlay's pods select (components/blackwell-8gpu; pool-1gpu: H100 and H200)
PRODUCTS = {"qwen3-8b-1gpu": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H200")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_resources_and_scheduling(rendered, overlay):
    js = _jobset(rendered[overlay])
    for st in STAGES:
        pod = _pod(js, st)
        containers = pod["containers"] + pod.get("initContainers", [])
        gpus = sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in containers)
        assert gpus == GPU[overlay].get(st, 0), (overlay, st)
        for c in containers:
            assert c["resources"]["requests"] == c["resources"]["limits"] or not gpus
        if gpus:
            tol = pod["tolerations"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tol
            terms = (pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                     ["nodeSelectorTerms"])
            keys = {(e["key"], tuple(e["values"])) for t in terms for e in t["matchExpressions"]}
            product = PRODUCTS.get(overlay, ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",))
            assert ("nvidia.com/gpu.product", product) in keys
            shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
            gpu_c = next(c for c in containers if c["resources"]["limits"].get("nvidia.com/gpu"))
            env = {e["name"]: e.get("value") for e in gpu_c["env"]}
            assert env["NCCL_P2P_LEVEL"] == "PHB"
            assert any(m["mountPath"] == "/dev/shm" for m in gpu_c["volumeMounts"])
        else:
            assert "tolerations" not in pod and "affinity" not in pod


def _tolerates(toleration: dict, taint: dict) -> bool:
    """Kubernetes' rule (k8s.io/api v0.33.0, Kubernetes 1.33, core/v1/toleration.go:38-56,
    `Toleration.ToleratesTaint`): an empty effect or key matches any; `Exists` matches any value, `Equal`
    (or no operator) the same value."""
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("key") and toleration["key"] != taint["key"]:
        return False
    op = toleration.get("operator") or "Equal"
    return op == "Exists" or (op == "Equal" and toleration.get("value", "") == taint.get("value", ""))


@pytest.mark.parametrize("overlay", ["smoke", "full", "full-multinode", "qwen3-8b-1gpu"])
def test_the_mirror_runs_on_a_pool_of_tainted_gpu_nodes_and_prefers_a_cpu_node(rendered, overlay):
    """A cluster whose only nodes are its GPU pool, tainted as GKE and the GPU Operator taint them, schedules
    the mirror (no GPU asked) there; where a node without a GPU exists, the mirror prefers it."""
    pod = _pod(_jobset(rendered[overlay]), "mirror")
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    assert any(_tolerates(t, taint) for t in pod["tolerations"])
    assert not _tolerates({"key": "nvidia.com/gpu", "operator": "Equal", "value": "x"}, taint)  # the rule itself
    (pref,) = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["preference"]["matchExpressions"] == [{"key": "nvidia.com/gpu.product", "operator": "DoesNotExist"}]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["nodeAffinity"]
    assert not any(c["resources"]["limits"].get("nvidia.com/gpu") for c in pod["containers"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context_restricted(rendered, overlay):
    for d in rendered[overlay]:
        pods = []
        if d["kind"] == "JobSet":
            pods = [_pod(d, rj["name"]) for rj in d["spec"]["replicatedJobs"]]
        elif d["kind"] == "Deployment":
            pods = [d["spec"]["template"]["spec"]]
        for pod in pods:
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
            # no API token, but in the guard, whose ServiceAccount may only read its JobSet and pods
            assert pod.get("automountServiceAccountToken") is (pod["serviceAccountName"] == "eagle-jobs-guard")
            assert not pod.get("hostIPC") and not pod.get("hostNetwork")
            assert not any("hostPath" in v for v in pod["volumes"])
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
                assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
                # every writable path is a volume
                mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
                assert "/tmp" in mounts


@pytest.mark.parametrize("overlay", ["smoke", "full", "full-multinode", "qwen3-8b-1gpu"])
def test_vllm_sidecar_is_never_restarted_by_a_probe_and_the_worker_waits_for_it(rendered, overlay):
    js = _jobset(rendered[overlay])
    for st in ("capture", "extract", "evaluate"):
        pod = _pod(js, st)
        prepare, side = pod["initContainers"]
        assert side["restartPolicy"] == "Always" and prepare["args"][:1] + prepare["args"][-4:-2] == [
            "serve-vllm", "--stage", st]
        # no probe that restarts it: a failing startup probe restarts a sidecar for ever and holds the worker
        # back (kubernetes v1.33 kuberuntime_container.go computeInitContainerActions); the worker waits for
        # /health itself, within the recipe's health_timeout_s, beating its heartbeat (vllm_server.wait_healthy)
        assert "startupProbe" not in side and "livenessProbe" not in side
        assert side["readinessProbe"]["httpGet"]["path"] == "/health"
        assert side["terminationMessagePolicy"] == "FallbackToLogsOnError"  # what the guard quotes
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["EAGLE_JOBS_VLLM_ENDPOINT"] == "http://127.0.0.1:8000"
        # evaluate's worker asks the sidecar for each of the servers prepare wrote (eagle_jobs.vllm_switch)
        written = prepare["args"][prepare["args"].index("--write") + 1]
        assert side["args"] == ["exec-vllm", written]
        assert env.get("EAGLE_JOBS_VLLM_PLANS") == (written if st == "evaluate" else None)
    assert "initContainers" not in _pod(js, "train")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_env_volumes_and_recipe(rendered, overlay):
    docs = rendered[overlay]
    js = _jobset(docs)
    images = {st: _pod(js, st)["containers"][0]["image"] for st in STAGES}
    if overlay == "dev":
        assert set(images.values()) == {"ghcr.io/eagle-jobs/dev:0.1.0"}
    else:
        assert images == {"capture": "ghcr.io/eagle-jobs/capture:0.1.0", "extract": "ghcr.io/eagle-jobs/extract:0.1.0",
                          "train": "ghcr.io/eagle-jobs/train:0.1.0", "evaluate": "ghcr.io/eagle-jobs/capture:0.1.0"}
    cm = _configmaps(docs)
    recipe_text = cm["eagle-jobs-recipe"]["recipe.yaml"]
    assert recipe_text == (REPO / "jobs" / f"{RECIPES[overlay]}.yaml").read_text()
    run = cm["eagle-jobs-run"]
    from eagle_jobs.recipe_file import recipe_from_text

    recipe = recipe_from_text(recipe_text)
    assert run["EAGLE_JOBS_RUN_ID"] == recipe.store.run_id
    assert js["metadata"]["labels"]["eagle-jobs/run-id"] == recipe.store.run_id
    for st in STAGES:
        pod = _pod(js, st)
        c = pod["containers"][0]
        assert c["args"][:3] == [st, "--recipe", "/etc/eagle-jobs/recipe.yaml"]
        refs = [next(iter(e.values()))["name"] for e in c["envFrom"]]
        assert GENERATED.match(refs[0])[1] == "eagle-jobs-run" and cm[refs[0]] is run and refs[1] == "eagle-jobs-store"
        assert not any("AWS_SECRET" in e["name"] or "AWS_ACCESS" in e["name"] for e in c["env"])  # never literal
        vols = {v["name"]: v for v in pod["volumes"]}
        assert cm[vols["recipe"]["configMap"]["name"]]["recipe.yaml"] == recipe_text
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HF_HOME"].startswith("/cache") and env["TRITON_CACHE_DIR"].startswith("/cache")
    for d in docs:  # no credential anywhere in the rendered objects
        assert "AWS_SECRET_ACCESS_KEY=" not in json.dumps(d)
        assert d["kind"] != "Secret"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_hold_only_per_run_objects_with_hashed_configmaps(rendered, overlay):
    """`kubectl delete -k k8s/overlays/<name>` (or skaffold's cleanup) deletes one run, never the namespace,
    its Secrets or another run; every ConfigMap the JobSet names is in the render, under a content hash."""
    docs = rendered[overlay]
    assert sorted({d["kind"] for d in docs}) == ["ConfigMap", "JobSet"]
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    assert all(GENERATED.match(n) for n in names), names
    text = json.dumps(_jobset(docs))
    refs = set(re.findall(r'"name": "(eagle-jobs-(?:run|recipe)[^"]*)"', text))
    assert refs == names  # rewritten by k8s/base/kustomizeconfig.yaml everywhere, components included


def test_another_recipe_is_another_configmap_so_a_running_jobset_keeps_its_own(rendered, tmp_path):
    """Applying the same overlay with an edited recipe creates a new ConfigMap (and the immutable JobSet
    refuses the changed template: a run is never switched to another recipe mid-run)."""
    edited = (REPO / "jobs/kimi-k2.5.yaml").read_text().replace("  lr: 1.0e-4\n", "  lr: 2.0e-4\n")
    assert edited != (REPO / "jobs/kimi-k2.5.yaml").read_text()

    def recipe_map(docs):
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("eagle-jobs-recipe-")]
        vol = next(v for v in _pod(_jobset(docs), "train")["volumes"] if v["name"] == "recipe")
        return cm["metadata"]["name"], vol["configMap"]["name"]

    before = recipe_map(rendered["full"])
    after = recipe_map(_render_overlay(tmp_path, {"resources": ["overlays/full"], "configMapGenerator": [
        {"name": "eagle-jobs-recipe", "behavior": "replace", "files": ["recipe.yaml"]}]}, {"recipe.yaml": edited}))
    assert before[0] == before[1] and after[0] == after[1] and before[0] != after[0]


@pytest.mark.parametrize("shared", SHARED)
def test_cluster_setup_validates_strictly(shared_rendered, shared, tmp_path):
    f = tmp_path / "docs.yaml"
    f.write_text(yaml.safe_dump_all(shared_rendered[shared]))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "-k", OLDEST_K8S, str(f)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("passed") == len(shared_rendered[shared]), r.stdout + r.stderr


def test_cluster_setup_holds_what_runs_share(shared_rendered):
    docs = shared_rendered["cluster-setup"]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert kinds == {("Namespace", "eagle-jobs"), ("ServiceAccount", "eagle-jobs-worker"),
                     ("ServiceAccount", "eagle-jobs-submitter"), ("Role", "eagle-jobs-submitter"),
                     ("RoleBinding", "eagle-jobs-submitter"), ("NetworkPolicy", "eagle-jobs-vllm-no-ingress"),
                     ("ServiceAccount", "eagle-jobs-guard"), ("Role", "eagle-jobs-guard"),
                     ("RoleBinding", "eagle-jobs-guard"),
                     ("PriorityClass", "eagle-jobs-preemptible"),
                     ("ValidatingAdmissionPolicy", "eagle-jobs-pinned-jobsets"),
                     ("ValidatingAdmissionPolicyBinding", "eagle-jobs-pinned-jobsets")}
    ns = next(d for d in docs if d["kind"] == "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    cluster_scoped = {"Namespace", "PriorityClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert all(d["metadata"].get("namespace") == "eagle-jobs" for d in docs if d["kind"] not in cluster_scoped)
    sa = next(d for d in docs if d["metadata"]["name"] == "eagle-jobs-worker")
    assert sa["automountServiceAccountToken"] is False
    # the guard reads, nothing more: its JobSet and the pods (src/eagle_jobs/cluster/guard.py)
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "eagle-jobs-guard"]
    assert {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]} == {("jobset.x-k8s.io", "jobsets", "get"), ("", "pods", "list")}
    (minio,) = [d for d in shared_rendered["dev-services"] if d["kind"] == "Deployment"]
    pod = minio["spec"]["template"]["spec"]  # the dev cluster's MinIO meets the namespace's restricted profile
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_names_unique_per_run_id(rendered):
    names = {o: _jobset(rendered[o])["metadata"]["name"] for o in OVERLAYS}
    assert len(set(names.values())) == len(OVERLAYS)
    for o in OVERLAYS:
        assert names[o].startswith("eagle-jobs-")


def test_multinode_training_rendezvous(rendered):
    js = _jobset(rendered["full-multinode"])
    job = _job(js, "train")
    assert job["completions"] == job["parallelism"] == 2
    env = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
    assert env["EAGLE_JOBS_NNODES"]["value"] == "2"
    assert env["EAGLE_JOBS_RDZV_ENDPOINT"]["value"] == "$(JOBSET_NAME)-train-0-0.$(JOBSET_NAME):29500"
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    single = _job(_jobset(rendered["full"]), "train")
    assert single["completions"] == 1


def test_recipe_copies_equal_jobs():
    for o, name in RECIPES.items():
        p = REPO / "k8s/overlays" / o / "recipe.yaml"
        if p.exists():
            assert p.read_text() == (REPO / "jobs" / f"{name}.yaml").read_text(), f"run `make k8s-recipes` ({p})"
    assert (REPO / "k8s/base/recipe.yaml").read_text() == (REPO / "jobs/demo-dev.yaml").read_text()


def test_yamllint():
    r = subprocess.run([sys.executable, "-m", "yamllint", "-c", str(REPO / ".yamllint.yaml"), "k8s", "jobs",
                        "skaffold.yaml"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    r = subprocess.run([exe, *sorted(str(p) for p in (REPO / "images").glob("*/Dockerfile"))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_skaffold_config():
    docs = [d for d in yaml.safe_load_all((REPO / "skaffold.yaml").read_text()) if d]
    (cfg,) = docs
    assert cfg["apiVersion"].startswith("skaffold/v4beta")
    arts = {a["image"]: a for a in cfg["build"]["artifacts"]}  # the GPU images; the dev profile builds images/dev
    assert set(arts) == {"ghcr.io/eagle-jobs/capture", "ghcr.io/eagle-jobs/extract", "ghcr.io/eagle-jobs/train"}
    for a in arts.values():
        assert (REPO / a["docker"]["dockerfile"]).is_file() and a.get("context", ".") == "."
    assert cfg["manifests"]["kustomize"]["paths"] == ["k8s/overlays/dev"]
    profiles = {p["name"]: p for p in cfg["profiles"]}
    assert set(profiles) == {"dev", "smoke", "full"}
    for name, p in profiles.items():
        paths = [op["value"] for op in p.get("patches", []) if op["path"] == "/manifests/kustomize/paths"]
        assert paths in ([], [[f"k8s/overlays/{name}"]])
    assert "--force" in json.dumps(cfg["deploy"]) or "force" in json.dumps(cfg["deploy"])


def skaffold_pushes(cfg: dict, profile: str, local_cluster: bool, push_flag: bool | None = None) -> bool:
    """skaffold v2.24.0's rule for a local build (pkg/skaffold/build/local/types.go:93-102): --push if given,
    else build.local.push if set (after the profile's patches), else the cluster's default, which pushes to
    a remote cluster and not to a local kind/k3d/minikube one (pkg/skaffold/config/util.go:284)."""
    local = dict(cfg["build"].get("local") or {})
    for p in cfg.get("profiles", []):
        if p["name"] == profile:
            for op in p.get("patches", []):
                if op["path"] == "/build/local":
                    local = dict(op["value"])
                elif op["path"] == "/build/local/push":
                    local["push"] = op["value"]
    if push_flag is not None:
        return push_flag
    if local.get("push") is not None:
        return bool(local["push"])
    return not local_cluster


def test_skaffold_pushes_to_a_real_cluster_and_loads_into_a_local_one():
    """The smoke and full profiles deploy to a real cluster, whose nodes pull only what a registry has: every
    profile pushes there; into a local dev cluster (kind, minikube) skaffold loads the images instead."""
    cfg = yaml.safe_load((REPO / "skaffold.yaml").read_text())
    for profile in ("dev", "smoke", "full"):
        assert skaffold_pushes(cfg, profile, local_cluster=False)
        assert not skaffold_pushes(cfg, profile, local_cluster=True)
    assert not skaffold_pushes({"build": {"local": {"push": False}}}, "full", local_cluster=False)  # the rule itself


# -- what a real cluster enforces beyond the CRD schema -----------------------------------------------
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def webhook_name_problems(js: dict) -> list[str]:
    """JobSet's validating webhook (pkg/webhooks/jobset_webhook.go, v0.12.0): the JobSet name (also its
    headless Service), the longest Job name <js>-<rjob>-<jobIdx> and the longest pod name
    <js>-<rjob>-<jobIdx>-<podIdx>-<5 random> are RFC-1035 labels of at most 63 characters."""
    name, bad = js["metadata"]["name"], []
    names = [name]
    for rj in js["spec"]["replicatedJobs"]:
        job = f"{name}-{rj['name']}-{rj.get('replicas', 1) - 1}"
        spec = rj["template"]["spec"]
        pods = max(spec.get("completions", 1) or 1, spec.get("parallelism", 1) or 1)
        names += [job, f"{job}-{pods - 1}-abcde"]
    for n in names:
        if len(n) > 63 or not RFC1035.match(n):
            bad.append(n)
    # the same webhook: a replicatedJob depends only on one listed before it
    seen: set[str] = set()
    for rj in js["spec"]["replicatedJobs"]:
        bad += [f"{rj['name']} cannot depend on {d['name']}"
                for d in rj.get("dependsOn") or [] if d["name"] not in seen]
        seen.add(rj["name"])
    return bad


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_jobset_webhook_admits_the_generated_names(rendered, overlay):
    js = _jobset(rendered[overlay])
    assert webhook_name_problems(js) == []
    if MIRRORED[overlay]:  # the mirror stage must come first: appended, capture would depend on a later job
        moved = copy.deepcopy(js)
        rjs = moved["spec"]["replicatedJobs"]
        rjs.append(rjs.pop(0))
        assert webhook_name_problems(moved) == ["capture cannot depend on mirror"]


def test_jobset_name_at_its_limit_is_admitted_and_one_more_is_refused(rendered):
    from eagle_jobs import cluster
    from eagle_jobs.errors import BadInput

    js = copy.deepcopy(_jobset(rendered["full"]))
    run_id = "r" * (cluster.MAX_JOBSET_NAME - len("eagle-jobs-"))
    js["metadata"]["name"] = cluster.jobset_name(run_id)
    assert len(js["metadata"]["name"]) == cluster.MAX_JOBSET_NAME and webhook_name_problems(js) == []
    js["metadata"]["name"] += "x"
    assert webhook_name_problems(js)  # what the webhook would refuse, jobset_name refuses first
    with pytest.raises(BadInput, match="too long"):
        cluster.jobset_name(run_id + "x")
    assert webhook_name_problems({**js, "metadata": {"name": "eagle-jobs-kimi-k2.5"}})  # the dot


QUALIFIED = re.compile(r"^[a-z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[\w][\w.-]{0,127}|@sha256:[0-9a-f]{64})$")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_has_a_registry_and_a_tag(rendered, overlay):
    """A short name resolves to docker.io/library/<name>:latest: ImagePullBackOff, a pod stuck in Init."""
    for d in rendered[overlay]:
        for pod in _pod_specs(d):
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                assert QUALIFIED.match(c["image"]) and "." in c["image"].split("/")[0], (overlay, c["name"], c["image"])


def _container_env(c: dict, cms: dict) -> dict:
    env = {k: v for ref in c.get("envFrom", []) if "configMapRef" in ref
           for k, v in cms[ref["configMapRef"]["name"]].items()}
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


@pytest.mark.parametrize("overlay", ["smoke", "full", "full-multinode", "qwen3-8b-1gpu"])
def test_vllm_pods_prepare_then_exec_the_command_for_the_first_and_last_index(rendered, overlay, tmp_path, moto_server):
    """What each vLLM sidecar runs, computed as the pod computes it: the prepare init container's args
    with its own env (not the worker's), for every completion index; then the sidecar execs exactly that:
    the verifier streamed from the store's mirror (moto stands in for the bucket, the AWS_* of the
    Secret come from its fixture)."""
    js = _jobset(rendered[overlay])
    cms = _configmaps(rendered[overlay])
    from eagle_jobs.recipe_file import recipe_from_text
    from eagle_jobs.store import Store

    # resolved as the pod resolves it: store:models/... under the store its ConfigMap names
    store = cms["eagle-jobs-run"]["EAGLE_JOBS_STORE"]
    verifier = recipe_from_text(cms["eagle-jobs-recipe"]["recipe.yaml"], overlay, store).verifier
    assert verifier.weights is not None and verifier.weights.startswith(store + "/models/")
    mirror = Store.open(verifier.weights)
    import boto3

    try:
        boto3.client("s3").create_bucket(Bucket=mirror.root.split("/")[0])
    except Exception as e:  # noqa: BLE001 - made by an earlier parameter of this test
        assert "BucketAlreadyOwnedByYou" in str(e)
    mirror.put_json("MIRROR.json", {"model": verifier.model, "revision": verifier.revision, "files": {}, "bytes": 0})
    secret = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "recipe.yaml").write_text(cms["eagle-jobs-recipe"]["recipe.yaml"])
    bindir = _printing_vllm(tmp_path)
    for stage in ("capture", "extract"):
        job = _job(js, stage)
        names = [c["name"] for c in job["template"]["spec"]["initContainers"]]
        assert names == ["prepare", "vllm"]  # regular first: it must succeed before vLLM starts
        prepare, sidecar = job["template"]["spec"]["initContainers"]
        assert "restartPolicy" not in prepare and sidecar["restartPolicy"] == "Always"
        assert prepare["args"][0] == "serve-vllm" and sidecar["args"][0] == "exec-vllm"
        n = job.get("completions", 1)
        for index in sorted({0, n - 1}):  # the first and the last: only the index differs between them
            (tmp_path / "work").mkdir(exist_ok=True)
            run_env = {"PATH": f"{bindir}:{os.environ['PATH']}", "HOME": str(tmp_path), **secret,
                       **_container_env(prepare, cms), "JOB_COMPLETION_INDEX": str(index), "HF_HUB_OFFLINE": "1"}
            r = _pod_cli(prepare, tmp_path, run_env)
            assert r.returncode == 0, (overlay, stage, index, r.stderr[-800:])
            r = _pod_cli(sidecar, tmp_path, {**run_env, **_container_env(sidecar, cms)})
            assert r.returncode == 0, (overlay, stage, index, r.stderr[-800:])
            cmd = r.stdout.splitlines()
            assert cmd[0] == str(bindir / "vllm") and cmd[1] == "serve"
            # the weights come from the mirror, each GPU streaming its slice (one GPU: the whole of it);
            # nothing names the hub
            assert cmd[2] == verifier.weights and cmd[cmd.index("--load-format") + 1] == "runai_streamer"
            tp = int(cmd[cmd.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in cmd else 1
            assert tp == GPU[overlay][stage], (overlay, stage, tp)
            if tp > 1:
                assert json.loads(cmd[cmd.index("--model-loader-extra-config") + 1]) == {"distributed": True}
            else:
                assert "--model-loader-extra-config" not in cmd
            assert cmd[cmd.index("--served-model-name") + 1] == verifier.model
            if stage == "extract":
                kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
                assert kv["kv_connector_extra_config"]["shared_storage_path"].endswith(f"-{index}")


def test_the_prepare_container_builds_every_plan_without_torch_or_transformers(tmp_path, monkeypatch):
    """`serve-vllm --write` runs before vLLM may start in every vLLM pod: it builds the stage's plan
    (eagle_jobs.serve_plans) without importing torch or transformers (seconds of start-up each)."""
    code = f"""
import sys
from pathlib import Path
from eagle_jobs.recipe import Recipe
from eagle_jobs.serve_plans import capture_plan, evaluate_plan, evaluate_plans, extract_plan
r = Recipe.model_validate({{"name": "x", "verifier": {{"model": "m", "num_layers": 8}}, "aux_layer_ids": [1, 4, 6],
                           "prompts": {{"source": "pypi://sharegpt"}},
                           "chat": {{"reasoning_parser": "kimi_k2"}}, "extract": {{"scratch_dir": {str(tmp_path)!r}}}}})
plans = [capture_plan(r), extract_plan(r, "run", 3), evaluate_plan(r, Path("/d")), evaluate_plan(r, None)]
assert plans[0].stage_args == ("--reasoning-parser", "kimi_k2") and plans[3].stage_args == ()
assert list(evaluate_plans(r, Path("/d"), Path("/u"))) == ["draft-k3", "untrained-k3", "no-draft"]
import eagle_jobs.cli, eagle_jobs.committed
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("overlay", ["smoke", "full", "qwen3-8b-1gpu"])
def test_a_bad_recipe_fails_the_prepare_container_and_the_job(rendered, overlay, tmp_path):
    """A check that fails before vLLM starts exits 3 in a regular init container: the pod fails, and
    podFailurePolicy fails the Job (a restartable sidecar exiting 3 would only crash-loop)."""
    js = _jobset(rendered[overlay])
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "recipe.yaml").write_text("name: x\nverifier: {model: m}\n")  # no prompts, no aux ids
    for stage in ("capture", "extract", "evaluate"):
        job = _job(js, stage)
        prepare = job["template"]["spec"]["initContainers"][0]
        r = _pod_cli(prepare, tmp_path, {**os.environ, "EAGLE_JOBS_STORE": f"file://{tmp_path}/store"})
        assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        rule = next(rl for rl in job["podFailurePolicy"]["rules"]
                    if rl.get("onExitCodes", {}).get("containerName") == "prepare" and 3 in rl["onExitCodes"]["values"])
        assert rule["action"] == "FailJob"


@pytest.mark.parametrize("overlay", ["smoke", "full", "full-multinode", "qwen3-8b-1gpu"])
def test_gpu_pods_land_on_the_product_and_ask_for_what_they_use(rendered, overlay):
    from eagle_jobs.recipe_file import recipe_from_text

    js = _jobset(rendered[overlay])
    cms = _configmaps(rendered[overlay])
    recipe = recipe_from_text(cms["eagle-jobs-recipe"]["recipe.yaml"])
    for st in STAGES:
        terms = (_pod(js, st)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                 ["nodeSelectorTerms"])
        keys = {e["key"] for t in terms for e in t["matchExpressions"]}
        assert "nvidia.com/gpu.product" in keys and "nvidia.com/gpu.family" not in keys  # family: B200/B300 too
    gpus = _pod(js, "train")["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == recipe.train.nproc_per_node  # the smoke run trains on one rank: one GPU


@pytest.mark.parametrize("overlay", ["smoke", "full", "full-multinode", "qwen3-8b-1gpu"])
def test_vllm_pods_keep_gpus_and_usage_stats_to_the_sidecar(rendered, overlay):
    js = _jobset(rendered[overlay])
    for st in ("capture", "extract", "evaluate"):
        pod = _pod(js, st)
        worker = pod["containers"][0]
        assert "nvidia.com/gpu" not in worker.get("resources", {}).get("limits", {})
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in worker["env"]
        (sidecar,) = [c for c in pod["initContainers"] if c["name"] == "vllm"]
        env = {e["name"]: e.get("value") for e in sidecar["env"]}
        assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_usage_errors_fail_the_job_instead_of_retrying(rendered, overlay):
    js = _jobset(rendered[overlay])
    for st in [rj["name"] for rj in js["spec"]["replicatedJobs"]]:
        rules = _job(js, st)["podFailurePolicy"]["rules"]
        fail = [r for r in rules if r["action"] in ("FailJob", "FailIndex")]
        assert any(2 in r["onExitCodes"]["values"] and 3 in r["onExitCodes"]["values"] for r in fail), st


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_stage_out_of_retries_is_restarted_and_bad_input_fails_the_run(rendered, overlay):
    fp = _jobset(rendered[overlay])["spec"]["failurePolicy"]
    assert fp["maxRestarts"] >= 1
    by_reason = {reason: r["action"] for r in fp["rules"] for reason in r["onJobFailureReasons"]}
    assert by_reason["BackoffLimitExceeded"] == by_reason["DeadlineExceeded"] == "RestartJobSet"
    assert by_reason["FailedIndexes"] == by_reason["MaxFailedIndexesExceeded"] == "RestartJobSet"
    assert by_reason["PodFailurePolicy"] == "FailJobSet"
    names = [r["name"] for r in fp["rules"]]  # the webhook's rule-name pattern
    assert all(re.match(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", n) for n in names)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_requests_the_disk_its_volumes_may_fill(rendered, overlay):
    """The scheduler places pods by ephemeral-storage requests; an emptyDir over its sizeLimit is evicted
    without a DisruptionTarget condition, so each eviction burns a retry (k8s-review B3)."""
    def gib(q: str) -> float:
        return float(q[:-2]) * {"Gi": 1, "Mi": 1 / 1024, "Ti": 1024}[q[-2:]]

    for d in rendered[overlay]:
        for pod in _pod_specs(d):
            disk = sum(gib(v["emptyDir"]["sizeLimit"]) for v in pod.get("volumes", [])
                       if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
            running = pod["containers"] + [c for c in pod.get("initContainers", [])
                                           if c.get("restartPolicy") == "Always"]
            asked = sum(gib(c.get("resources", {}).get("requests", {}).get("ephemeral-storage", "0Gi"))
                        for c in running)
            assert asked >= disk > 0, (overlay, d["metadata"]["name"], asked, disk)
            # a memory-backed emptyDir (/dev/shm) is charged to the pod's memory limit: it must fit inside it
            shm = sum(gib(v["emptyDir"]["sizeLimit"]) for v in pod.get("volumes", [])
                      if v.get("emptyDir", {}).get("medium") == "Memory")
            memory = sum(gib(c.get("resources", {}).get("limits", {}).get("memory", "0Gi")) for c in running)
            assert shm < memory or not shm, (overlay, d["metadata"]["name"], shm, memory)


@pytest.mark.parametrize("overlay", ["smoke", "full", "full-multinode", "qwen3-8b-1gpu"])
def test_no_other_pod_reaches_the_vllm_port_and_training_still_rendezvous(rendered, shared_rendered, overlay):
    js = _jobset(rendered[overlay])
    (pol,) = [d for d in shared_rendered["cluster-setup"] if d["kind"] == "NetworkPolicy"]
    assert pol["metadata"]["namespace"] == js["metadata"]["namespace"]
    assert pol["spec"]["policyTypes"] == ["Ingress"] and pol["spec"]["ingress"] == []

    def selected(labels: dict) -> bool:  # matchExpressions, operator In, as the API server evaluates them
        sel = pol["spec"]["podSelector"]
        return all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()) and all(
            labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", []))

    for rj in js["spec"]["replicatedJobs"]:
        tpl = rj["template"]["spec"]["template"]
        serves = any(c["name"] == "vllm" for c in tpl["spec"].get("initContainers", []))
        assert selected(tpl["metadata"]["labels"]) == serves, rj["name"]  # train's rendezvous stays open


@pytest.mark.parametrize("overlay", ["smoke", "full", "qwen3-8b-1gpu"])
def test_the_mirror_stage_copies_the_pinned_revision_into_the_store(rendered, overlay, tmp_path):
    """The mirror pod's command with its rendered env, on a recipe whose model is a local directory
    (no hub here): files land under verifier.weights, MIRROR.json last, and a second run copies nothing."""
    js = _jobset(rendered[overlay])
    pod = _pod(js, "mirror")
    (c,) = pod["containers"]
    assert c["image"] == _pod(js, "train")["containers"][0]["image"]  # no vLLM needed to copy files
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert set(pod["affinity"]["nodeAffinity"]) == {"preferredDuringSchedulingIgnoredDuringExecution"}  # any node
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    cms = _configmaps(rendered[overlay])
    recipe = yaml.safe_load(cms["eagle-jobs-recipe"]["recipe.yaml"])
    recipe["verifier"].update(model=str(model), weights=f"file://{tmp_path}/store/models/m")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    args = [a.replace("/etc/eagle-jobs", str(tmp_path / "etc")) for a in c["args"]]
    env = {**os.environ, **_container_env(c, cms), "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           "EAGLE_JOBS_CACHE": str(tmp_path / "cache"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "HF_HOME": str(tmp_path / "cache")}
    for expect in ("2 files copied", "already in"):
        r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", *args], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0 and expect in r.stdout, r.stderr
    manifest = json.loads((tmp_path / "store/models/m/MIRROR.json").read_text())
    assert manifest["files"] == {"config.json": 2, "model.safetensors": 4096}



def test_operations_node_sizes_are_the_rendered_requests(rendered):
    """docs/OPERATIONS.md#node-sizes says what a node must have; it stays equal to what `full` asks for."""
    text = (REPO / "docs/OPERATIONS.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (\d+) \| (\d+) \| (\d+) GiB \| (\d+) \| (\d+) GiB \|$", text, re.M)

    def q(v) -> float:
        v = str(v)
        return float(v[:-2]) * {"Gi": 1, "Mi": 1 / 1024}[v[-2:]] if v[-2:] in ("Gi", "Mi") else float(v)

    js = _jobset(rendered["full"])
    want = {}
    for rj in js["spec"]["replicatedJobs"]:
        if rj["name"] == "guard":  # a tenth of a CPU on any node: the table is about the nodes the stages need
            continue
        pod = rj["template"]["spec"]["template"]["spec"]
        run = pod["containers"] + [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        tot = [sum(q(c["resources"]["requests"].get(k, 0)) for c in run)
               for k in ("cpu", "memory", "nvidia.com/gpu", "ephemeral-storage")]
        want[rj["name"]] = (rj["template"]["spec"]["completions"], *tot)
    assert {r[0]: tuple(float(x) for x in r[1:]) for r in rows} == {k: tuple(map(float, v)) for k, v in want.items()}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "full-b200", "full-gb200"])
def test_the_evaluate_worker_holds_the_untrained_draft_its_recipe_builds(overlay):
    """evaluate's worker builds the untrained draft (the τ baseline) in its own container, beside the vLLM
    sidecar: its memory limit covers `plan`'s bound on that build at the overlay recipe's draft shape
    (9.2 GiB for Kimi-K2.5; 8.9 GiB measured by benchmarks/bench_untrained_draft.py) with a fifth spare,
    as the scale rehearsal asks of every pod (benchmarks/scale/rehearse.py HEADROOM)."""
    from eagle_jobs.plan import make_plan
    from eagle_jobs.recipe_file import recipe_from_text

    docs = kustomize(REPO / "k8s/overlays" / overlay)
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "recipe.yaml" in d.get("data", {}))
    bound = make_plan(recipe_from_text(cm["data"]["recipe.yaml"]))["untrained_draft_bytes"]
    evaluate = next(rj for rj in _jobset(docs)["spec"]["replicatedJobs"] if rj["name"] == "evaluate")
    worker = evaluate["template"]["spec"]["template"]["spec"]["containers"][0]
    limit = worker["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and bound <= 0.8 * int(limit[:-2]) * 2**30, (overlay, limit, bound / 2**30)


def test_weights_volume_component_mounts_the_claim_read_only_where_the_verifier_is_read(tmp_path):
    """components/weights-volume, the alternative to streaming from the store: an overlay made of the
    full run's components with weights-volume in place of verifier-mirror. Every container that reads
    the verifier mounts the ReadOnlyMany claim at /models read-only, the JobSet still validates and is
    admitted, and the vLLM sidecar serves the mounted directory in place (no runai, no hub)."""
    import jsonschema

    weights = "file:///models/moonshotai/Kimi-K2.5/4d01dfe0332d63057c186e0b262165819efb6611"
    recipe = yaml.safe_load((REPO / "jobs/kimi-k2.5.yaml").read_text())
    recipe["verifier"]["weights"] = weights
    docs = _render_overlay(tmp_path, {
        "resources": ["base"],
        "components": [f"components/{c}" for c in ("blackwell-8gpu", "vllm-sidecar", "weights-volume")],
        "configMapGenerator": [{"name": "eagle-jobs-recipe", "behavior": "replace", "files": ["recipe.yaml"]}]},
        {"recipe.yaml": yaml.safe_dump(recipe)})
    js = _jobset(docs)
    assert [rj["name"] for rj in js["spec"]["replicatedJobs"]] == [*STAGES, "guard"]
    jsonschema.validate(js, _jobset_schema())
    assert webhook_name_problems(js) == []
    for stage in STAGES:
        pod = _pod(js, stage)
        (vol,) = [v for v in pod["volumes"] if v["name"] == "weights"]
        assert vol["persistentVolumeClaim"] == {"claimName": "eagle-jobs-weights", "readOnly": True}
        containers = pod.get("initContainers", []) + pod["containers"]
        assert [c["name"] for c in containers] == (["worker"] if stage == "train" else ["prepare", "vllm", "worker"])
        for c in containers:
            assert ({"name": "weights", "mountPath": "/models", "readOnly": True}
                    in c["volumeMounts"]), (stage, c["name"])
    # what the capture sidecar runs with that recipe: the mounted directory, checked by prepare first
    local = tmp_path / "models" / weights.removeprefix("file:///models/")
    local.mkdir(parents=True)
    here = yaml.safe_dump({**recipe, "verifier": {**recipe["verifier"], "weights": f"file://{local}"}})
    (tmp_path / "etc").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "etc" / "recipe.yaml").write_text(here)
    prepare, sidecar = _pod(js, "capture")["initContainers"]
    bindir = _printing_vllm(tmp_path)
    env = {**os.environ, "EAGLE_JOBS_STORE": f"file://{tmp_path}/store", "HOME": str(tmp_path),
           "JOB_COMPLETION_INDEX": "0", "HF_HUB_OFFLINE": "1", "PATH": f"{bindir}:{os.environ['PATH']}"}
    r = _pod_cli(prepare, tmp_path, env)
    assert r.returncode == 3 and "MIRROR.json" in r.stderr  # nothing mounted there yet: refused before vLLM
    (local / "MIRROR.json").write_text(json.dumps({"model": recipe["verifier"]["model"],
                                                   "revision": recipe["verifier"]["revision"],
                                                   "files": {}, "bytes": 0}))
    assert _pod_cli(prepare, tmp_path, env).returncode == 0
    r = _pod_cli(sidecar, tmp_path, env)
    assert r.returncode == 0, r.stderr[-800:]
    cmd = r.stdout.splitlines()
    assert cmd[:3] == [str(bindir / "vllm"), "serve", str(local)]
    assert "--load-format" not in cmd and "--revision" not in cmd


def test_monitoring_scrapes_the_vllm_port_and_only_prometheus_may_reach_it(rendered):
    docs = {d["kind"]: d for d in kustomize(REPO / "k8s/monitoring")}
    pm, pol = docs["PodMonitor"], docs["NetworkPolicy"]
    assert pm["metadata"]["namespace"] == pol["metadata"]["namespace"] == "eagle-jobs"
    js = _jobset(rendered["full"])

    def selected(sel, labels):
        return all(labels.get(e["key"]) in e["values"] for e in sel["matchExpressions"])

    for rj in js["spec"]["replicatedJobs"]:
        tpl = rj["template"]["spec"]["template"]
        sidecar = next((c for c in tpl["spec"].get("initContainers", []) if c["name"] == "vllm"), None)
        assert selected(pm["spec"]["selector"], tpl["metadata"]["labels"]) == (sidecar is not None), rj["name"]
        assert selected(pol["spec"]["podSelector"], tpl["metadata"]["labels"]) == (sidecar is not None)
        if sidecar is not None:  # the endpoint's port name is the sidecar's, and the policy opens that port
            (ep,) = pm["spec"]["podMetricsEndpoints"]
            port = next(p for p in sidecar["ports"] if p["name"] == ep["port"])
            assert ep["path"] == "/metrics" and pol["spec"]["ingress"][0]["ports"] == [
                {"protocol": "TCP", "port": port["containerPort"]}]
    assert pol["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_kueue_component_queues_the_whole_jobset(tmp_path):
    js = _jobset(_render_overlay(tmp_path, {"resources": ["overlays/full"], "components": ["components/kueue"]}))
    # Kueue (kueue.x-k8s.io, JobSet integration) manages a JobSet that carries this label on itself
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "eagle-jobs"
    assert webhook_name_problems(js) == []
    assert (REPO / "docs/OPERATIONS.md").read_text().count("components/kueue") >= 1


def test_dev_sidecars_serve_the_demo_on_cpu_where_probes_and_workers_look(rendered, tmp_path):
    """The dev overlay's vLLM pods, as each container computes its command with its rendered env: the
    prepare container writes `vllm serve` for vllm-cpu (the demo's verifier, this repository's CPU flags),
    on 0.0.0.0 at the port the sidecar's probes and the worker's endpoint use."""
    js = _jobset(rendered["dev"])
    cms = _configmaps(rendered["dev"])
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "recipe.yaml").write_text(cms["eagle-jobs-recipe"]["recipe.yaml"])
    bindir = _printing_vllm(tmp_path)
    from eagle_jobs import vllm_cpu

    # evaluate's prepare first downloads the trained draft; its command is the same but for the draft
    for stage in ("capture", "extract"):
        pod = _pod(js, stage)
        inits = {c["name"]: c for c in pod["initContainers"]}
        prepare, sidecar, worker = inits["prepare"], inits["vllm"], pod["containers"][0]
        (tmp_path / "work").mkdir(exist_ok=True)
        pod_env = {k: v.replace("/cache", str(tmp_path / "cache")) for k, v in _container_env(prepare, cms).items()}
        env = {**os.environ, **pod_env, "HOME": str(tmp_path), "JOB_COMPLETION_INDEX": "0",
               "EAGLE_JOBS_STORE": f"file://{tmp_path}/store", "PATH": f"{bindir}:{os.environ['PATH']}",
               # the GGUF converted once per machine, as every other test here finds it
               "EAGLE_JOBS_CACHE": os.environ.get("EAGLE_JOBS_CACHE", str(Path.home() / ".cache" / "eagle-jobs"))}
        env.pop("AWS_ENDPOINT_URL")  # the in-cluster MinIO: a local store stands in for it
        r = _pod_cli(prepare, tmp_path, env, timeout=300)
        assert r.returncode == 0, (stage, r.stderr[-800:])
        r = _pod_cli(sidecar, tmp_path, {**env, **_container_env(sidecar, cms)})
        assert r.returncode == 0, (stage, r.stderr[-800:])
        cmd = r.stdout.splitlines()
        assert cmd[:2] == [str(bindir / "vllm"), "serve"]
        assert Path(cmd[2], "config.json").is_file()  # the GGUF, converted to a model dir
        host = len(cmd) - 1 - cmd[::-1].index("--host")  # the last --host wins
        assert cmd[host + 1] == "0.0.0.0", cmd  # the kubelet probes the pod IP
        port = int(cmd[cmd.index("--port") + 1])
        assert sidecar["readinessProbe"]["httpGet"]["port"] == port
        assert _container_env(worker, cms)["EAGLE_JOBS_VLLM_ENDPOINT"] == f"http://127.0.0.1:{port}"
        if vllm_cpu.is_cpu_build():
            cpu_args = vllm_cpu.serve_args()
            assert cmd[-len(cpu_args):] == cpu_args  # eager, native rope, CPU_MLA: exact on CPU
