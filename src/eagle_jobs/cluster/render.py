"""Rendering a run: an overlay built by kustomize, made one run's (a unique JobSet name, the run id in
labels, in per-run ConfigMap names and in the store path), its images optionally pinned by digest."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from eagle_jobs.cluster.api import jobset_name
from eagle_jobs.errors import BadInput
from eagle_jobs.layout import content_hash


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
RECIPE_LABEL = "eagle-jobs/recipe"  # on the JobSet: the recipe's name, what `submit` runs one of at a time


def recipe_label(recipe_yaml: str) -> str | None:
    """The recipe's `name` as a label value: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends, as the
    API server validates it (k8s.io/apimachinery v0.33.0 pkg/util/validation/validation.go:154-165,
    IsValidLabelValue)."""
    import yaml

    name = str((yaml.safe_load(recipe_yaml) or {}).get("name") or "")
    value = re.sub(r"[^A-Za-z0-9._-]", "-", name)[:63].strip("._-")
    return value or None



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
    from eagle_jobs.recipe_file import load_recipe

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
    recipe_name = next((recipe_label(d["data"]["recipe.yaml"]) for d in out
                        if d["kind"] == "ConfigMap" and "recipe.yaml" in d.get("data", {})), None)
    for d in out:
        if d["kind"] == "JobSet" and recipe_name:
            d["metadata"]["labels"][RECIPE_LABEL] = recipe_name
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
