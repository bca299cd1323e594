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
    assert "--constraint constraints.txt" in dockerfile and "--no-deps speculators==0.9.0" in dockerfile
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
           "--python-version", py, "--only-binary=:all:", "-c", str(REPO / "images" / image / "constraints.txt"),
           *[a for p in PLATFORMS for a in ("--platform", p)], *extra, *deps]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    constraints = dict(line.split("==") for line in (REPO / "images" / image / "constraints.txt").read_text().splitlines()
                       if "==" in line and not line.startswith("#"))
    from packaging.version import Version

    # the base image's torch is not disturbed (a local +cpu build of the same release counts)
    assert Version(got["torch"]).base_version == constraints["torch"]
    assert "torchvision" not in got or got["torchvision"] == constraints.get("torchvision")
    assert Version("5.16.1") <= Version(got["transformers"]) <= Version("5.19.0")
