"""Helpers the Kubernetes tests share: reading a rendered JobSet and its pods, rendering an overlay written
for one test, and a GPU node's labels matched against a pod's node affinity.

GFD's labels are computed here as GFD computes them, from the NVML device names (NVIDIA/k8s-device-plugin
v0.18.0 internal/lm/resource.go: getProductName 189-206, sanitise 316-324: characters outside
[A-Za-z0-9-_. ] dropped, each run of spaces made one '-'); gpu.count counts the node's GPUs of that name
(internal/lm/mig-strategy.go:126-177); cuda.driver-version.major is the driver's major version
(internal/lm/nvml.go:134-137). A node-affinity `Gt` compares the label as an integer (k8s.io/apimachinery
v0.33.0 pkg/labels/selector.go:253-260: an absent or non-integer label does not match).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from conftest import kustomize

REPO = Path(__file__).resolve().parents[1]


# -- a rendered overlay (tests/test_k8s.py) -----------------------------------------------------------------
def _jobset(docs) -> dict:
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    return js


def _job(js, stage) -> dict:
    return next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == stage)["template"]["spec"]


def _pod(js, stage) -> dict:
    return _job(js, stage)["template"]["spec"]


def _render_overlay(tmp_path: Path, kustomization: dict, files: dict[str, str] | None = None) -> list[dict]:
    """An overlay written for one test, its paths relative to this repository's k8s/ (kustomize refuses
    absolute ones), rendered as `kubectl kustomize` renders the shipped ones."""
    ovl = tmp_path / "overlay"
    ovl.mkdir()
    rel = os.path.relpath(REPO / "k8s", ovl)
    k = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **kustomization}
    for key in ("resources", "components"):
        if key in k:
            k[key] = [f"{rel}/{x}" for x in k[key]]
    (ovl / "kustomization.yaml").write_text(yaml.safe_dump(k))
    for name, text in (files or {}).items():
        (ovl / name).write_text(text)
    return kustomize(ovl)


def _pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"]["spec"] for rj in doc["spec"]["replicatedJobs"]]
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "Pod":
        return [doc["spec"]]
    return []


# -- GPU nodes as GPU Feature Discovery labels them (tests/test_k8s_pools.py) -------------------------------
def gfd_product(nvml_name: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", nvml_name).split())


def node(nvml_name: str, gpus: int, arch: str, driver: int) -> dict[str, str]:
    """A GPU node's labels as GFD and the kubelet set them."""
    return {"nvidia.com/gpu.product": gfd_product(nvml_name), "nvidia.com/gpu.count": str(gpus),
            "nvidia.com/cuda.driver-version.major": str(driver), "kubernetes.io/arch": arch}


def matches(term: dict, labels: dict[str, str]) -> bool:
    """A nodeSelectorTerm's matchExpressions against a node's labels (k8s.io/component-helpers v0.33.0
    scheduling/corev1/nodeaffinity/nodeaffinity.go: every expression must hold; In, NotIn, Exists,
    DoesNotExist, Gt, Lt as apimachinery's labels.Requirement.Matches)."""
    for e in term["matchExpressions"]:
        have, op = labels.get(e["key"]), e["operator"]
        if op == "In" and have not in e["values"]:
            return False
        if op == "Exists" and have is None:
            return False
        if op == "DoesNotExist" and have is not None:
            return False
        if op in ("Gt", "Lt"):
            if have is None or not re.fullmatch(r"-?\d+", have):
                return False
            if not (int(have) > int(e["values"][0]) if op == "Gt" else int(have) < int(e["values"][0])):
                return False
    return True


def schedulable(pod: dict, labels: dict[str, str]) -> bool:
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(matches(t, labels) for t in terms)
