"""What skaffold does to rendered manifests before it applies them: rewrite images to the tags it built and add
its run labels, in the kinds its allowlist names. Ported from GoogleContainerTools/skaffold v2.24.0
(commit b0d643a5b5944a7d3f82bd5c00d5eaa0902226bd), no skaffold binary being installable here:

- pkg/skaffold/render/renderer/util/util.go: GenerateHydratedManifests calls ReplaceImages (line 49), then
  SetLabels (line 55); ConsolidateTransformConfiguration (lines 98-126) starts from the default
  TransformAllowlist/TransformDenylist, and each `resourceSelector.allow` entry of skaffold.yaml replaces the
  entry of its GroupKind (apimachinery ParseGroupKind: "JobSet.jobset.x-k8s.io" is kind JobSet, group
  jobset.x-k8s.io) and removes it from the denylist.
- pkg/skaffold/kubernetes/manifest/visitor.go: TransformAllowlist (lines 36-194: Pod, Deployment, Job, ...,
  no JobSet); traverseManifestFields (243-264): a manifest whose GroupKind is allowed is visited
  recursively (recursiveVisitorDecorator, 307-312), any other only at its top-level keys; visitFields
  (316-328) walks maps and lists.
- pkg/skaffold/kubernetes/manifest/images.go: allowByNavpath (67-101): with image `.*`, every key `image`
  is allowed; imageReplacer.Visit (189-239) replaces an allowed `image` whose name (no tag) is an
  artifact's (selectLocalManifestImages, 252-264: never one pinned by digest) and stops there.
- pkg/skaffold/kubernetes/manifest/labels.go: allowByNavpath (61-108): with labels `.*`, every key
  `metadata`; labelsSetter.Visit (137-169) adds the labels a metadata lacks (skaffold.dev/run-id always).

Config Connector kinds (ConfigConnectorResourceSelector) are left out: no manifest of ours is one.
"""

from __future__ import annotations

import copy

# visitor.go TransformAllowlist: the built-in kinds (all with image and labels ".*"); JobSet is not one
DEFAULT_ALLOW = {("", "Pod"), ("", "Service"), ("apps", "DaemonSet"), ("apps", "Deployment"), ("apps", "ReplicaSet"),
                 ("apps", "StatefulSet"), ("batch", "CronJob"), ("batch", "Job"), ("extensions", "DaemonSet"),
                 ("extensions", "Deployment"), ("extensions", "ReplicaSet"), ("serving.knative.dev", "Service"),
                 ("agones.dev", "Fleet"), ("agones.dev", "GameServer"), ("argoproj.io", "Rollout"),
                 ("argoproj.io", "Workflow"), ("argoproj.io", "CronWorkflow"), ("argoproj.io", "WorkflowTemplate"),
                 ("argoproj.io", "ClusterWorkflowTemplate"), ("run.googleapis.com", "Job"),
                 ("run.googleapis.com", "WorkerPool")}
ALL = {"image": [".*"], "labels": [".*"]}


def parse_group_kind(gk: str) -> tuple[str, str]:
    """apimachinery schema.ParseGroupKind: the kind before the first dot, the group after it."""
    kind, _, group = gk.partition(".")
    return group, kind


def allowlist(resource_selector: dict | None) -> dict[tuple[str, str], dict]:
    out = {gk: ALL for gk in DEFAULT_ALLOW}
    for rf in (resource_selector or {}).get("allow", []):
        out[parse_group_kind(rf["groupKind"])] = {"image": rf.get("image", []), "labels": rf.get("labels", [])}
    for rf in (resource_selector or {}).get("deny", []):
        out.pop(parse_group_kind(rf["groupKind"]), None)
    return out


def _group_kind(doc: dict) -> tuple[str, str]:
    api = doc.get("apiVersion", "")
    return (api.split("/")[0] if "/" in api else ""), doc.get("kind", "")


def _split(image: str) -> tuple[str, str | None]:
    """(name, digest): docker.ParseReference's BaseName is the name without tag or digest."""
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name[: name.rindex(":")]
    return name, digest or None


def transform(docs: list[dict], builds: dict[str, str], labels: dict[str, str],
              resource_selector: dict | None) -> list[dict]:
    """The manifests as skaffold applies them: builds maps an artifact's image name to the tag it built."""
    allow = allowlist(resource_selector)
    out = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        rf = allow.get(_group_kind(doc))
        _visit(doc, rf, _replace_image(builds))  # ReplaceImages first
        _visit(doc, rf, _set_labels(labels))  # then SetLabels
        out.append(doc)
    return out


def _visit(doc: dict, rf: dict | None, visitor) -> None:
    """traverseManifestFields: recursive where the kind is allowed, else the top-level keys only."""
    def walk(o):
        if isinstance(o, list):
            for v in o:
                walk(v)
        elif isinstance(o, dict):
            for k, v in list(o.items()):
                if visitor(rf, o, k, v) and rf is not None:  # recursiveVisitorDecorator
                    walk(v)
    walk(doc)


def _replace_image(builds: dict[str, str]):
    def visit(rf, o, k, v) -> bool:
        if not (rf and k == "image" and ".*" in rf["image"]) or not isinstance(v, str):
            return True
        name, digest = _split(v)
        if digest is None and name in builds:  # selectLocalManifestImages
            o[k] = builds[name]
        return False
    return visit


def _set_labels(labels: dict[str, str]):
    def visit(rf, o, k, v) -> bool:
        if not (rf and k == "metadata" and ".*" in rf["labels"]) or not isinstance(v, dict):
            return True
        have = v.setdefault("labels", {})
        for name, value in labels.items():
            if name not in have or name == "skaffold.dev/run-id":
                have[name] = value
        return False
    return visit
