"""Preemption, the manifest half: a grace period that fits one checkpoint save, and the
optional components/preemptible (a low priority class, the autoscaler's safe-to-evict), on the render.

The save estimate is plan.make_plan's `train_checkpoint` (the draft's bf16 weights and Adam moments,
as speculators' checkpointer writes them: convert_float_dtype to bfloat16), at write and export
speeds measured on this machine and a store bandwidth of at most 100 MB/s. The steps lost without
any grace (a spot VM's notice) are bounded by train.checkpoint_every_minutes: the training half.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import kustomize
from k8s_failure_sim import failed_pod, run_jobset

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ["dev", "smoke", "full", "full-multinode", "qwen3-8b-1gpu"]
SLOW_STORE_BPS = 100e6  # a store slower than this makes the SIGTERM save the operator's to size


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: kustomize(REPO / "k8s/overlays" / o) for o in OVERLAYS}


def _jobset(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "JobSet")


def _pod(js: dict, stage: str) -> dict:
    return next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == stage)["template"]["spec"]["template"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_train_pods_grace_fits_one_checkpoint_save(rendered, overlay):
    from eagle_jobs.plan import checkpoint_save_s, make_plan
    from eagle_jobs.recipe_file import recipe_from_text
    from eagle_jobs.train.launch import RANK_SHUTDOWN_TIMEOUT_S

    docs = rendered[overlay]
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "recipe.yaml" in d.get("data", {}))
    recipe = recipe_from_text(cm["data"]["recipe.yaml"])
    ckpt = make_plan(recipe)["train_checkpoint"]
    save_s = checkpoint_save_s(ckpt["bytes"], min(recipe.plan.store_bytes_per_s, SLOW_STORE_BPS))
    # the ranks save within torchrun's shutdown timeout, and that within the pod's grace, with time to exit
    grace = _pod(_jobset(docs), "train")["spec"]["terminationGracePeriodSeconds"]
    assert save_s <= RANK_SHUTDOWN_TIMEOUT_S <= grace - 20, (overlay, ckpt, save_s, RANK_SHUTDOWN_TIMEOUT_S, grace)
    if overlay == "full":  # Kimi-K2.5's draft: 8.6 GB (the documented figure)
        assert 8.4e9 < ckpt["bytes"] < 8.8e9 and 140 < save_s < 160
    # docs/ARCHITECTURE.md states both numbers
    arch = (Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    assert f"gives torchrun a {RANK_SHUTDOWN_TIMEOUT_S} s\n  shutdown grace (inside the train pod's {grace} s)" in arch


def _overlay(tmp_path: Path, components: list[str]) -> list[dict]:
    ovl = tmp_path / "overlay"
    ovl.mkdir(exist_ok=True)
    rel = os.path.relpath(REPO / "k8s", ovl)
    (ovl / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{rel}/base"], "components": [f"{rel}/components/{c}" for c in components]}))
    return kustomize(ovl)


def test_the_preemptible_component_lowers_priority_and_lets_the_autoscaler_evict(tmp_path, rendered):
    import jobset_admission

    docs = _overlay(tmp_path, ["blackwell-8gpu", "vllm-sidecar", "preemptible", "verifier-mirror"])
    js = _jobset(docs)
    for rj in js["spec"]["replicatedJobs"]:
        pod = _pod(js, rj["name"])
        if rj["name"] in ("mirror", "guard"):  # CPU-only, resumable or stateless: the default priority
            assert "priorityClassName" not in pod["spec"]
            continue
        assert pod["spec"]["priorityClassName"] == "eagle-jobs-preemptible"
        assert pod["metadata"]["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "true"}
        assert pod["metadata"]["labels"]["eagle-jobs/stage"] == rj["name"]  # the patch kept the labels
    for version in jobset_admission.VERSIONS:  # the oldest and newest JobSet admit it
        assert jobset_admission.create_status(js, version) is None, version
    # without it, nothing changes
    assert all("priorityClassName" not in _pod(_jobset(rendered["full"]), s)["spec"] for s in ("capture", "train"))
    # the class it names is cluster-setup's: below pods with none (0), and never preempting others
    (pc,) = [d for d in kustomize(REPO / "k8s/cluster-setup") if d["kind"] == "PriorityClass"]
    assert pc["metadata"]["name"] == "eagle-jobs-preemptible" and "namespace" not in pc["metadata"]
    assert pc["value"] < 0 and pc["preemptionPolicy"] == "Never" and pc["globalDefault"] is False
    f = tmp_path / "core.yaml"
    f.write_text(yaml.safe_dump_all([pc]))
    exe = Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "-k", "1.33.0", str(f)], capture_output=True, text=True)
    assert r.returncode == 0 and "passed" in r.stdout, r.stdout + r.stderr
    # a preemption costs no retry, however often (DisruptionTarget is every stage's first rule)
    preempted = [(0, failed_pod(worker=143, disrupted=True))] * 8
    run = run_jobset(js, [{"train": {"fail": preempted}, "extract": {"fail": preempted}}])
    assert (run.state, run.restarts) == ("Completed", 0)


def test_the_preemptible_component_refuses_to_patch_moved_stages(tmp_path):
    """Listed after verifier-mirror, the indexes point one stage off: its test ops stop the render."""
    ovl = tmp_path / "late"
    ovl.mkdir()
    with pytest.raises(AssertionError, match="testing value"):
        _overlay(ovl, ["blackwell-8gpu", "vllm-sidecar", "verifier-mirror", "preemptible"])
