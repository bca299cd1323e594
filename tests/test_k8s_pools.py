"""The node pools users have (docs/OPERATIONS.md#node-pools): each pool's overlay renders pods that schedule
onto that pool's GPU Feature Discovery labels, ask for what its nodes have, run images published for its
architecture, and are what `plan` prices for that pool.

The GPU nodes' labels come from tests/k8s_helpers.py, computed as GPU Feature Discovery computes them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import kustomize
from k8s_helpers import node, schedulable

from eagle_jobs.plan import make_plan
from eagle_jobs.recipe import Recipe
from eagle_jobs.recipe_file import recipe_from_text

REPO = Path(__file__).resolve().parents[1]


# Each pool: its nodes as NVML and the kubelet describe them, and the overlay that targets it.
POOLS = {
    "full": {"nvml": ["NVIDIA RTX PRO 6000 Blackwell Server Edition"], "gpus": 8, "arch": "amd64", "driver": 580},
    "full-b200": {"nvml": ["NVIDIA B200", "NVIDIA B300 SXM6 AC"], "gpus": 8, "arch": "amd64", "driver": 580},
    "full-gb200": {"nvml": ["NVIDIA GB200"], "gpus": 4, "arch": "arm64", "driver": 580},
}
VLLM_STAGES = ("capture", "extract", "evaluate")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: kustomize(REPO / "k8s/overlays" / o) for o in POOLS}


def _jobset(docs):
    return next(d for d in docs if d["kind"] == "JobSet")


def _rj(js, name):
    return next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == name)


def _recipe(docs) -> Recipe:
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "recipe.yaml" in d.get("data", {}))
    return recipe_from_text(cm["data"]["recipe.yaml"])


def _gpus(pod: dict) -> int:
    run = pod["containers"] + [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    return sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in run)


def published_platforms() -> dict[str, set[str]]:
    """Per image, the platforms release.yml publishes it for (amd64 where none is named)."""
    wf = yaml.safe_load((REPO / ".github/workflows/release.yml").read_text())
    steps = wf["jobs"]["images"]["steps"]
    build = next(s for s in steps if s.get("id") == "build")
    out = {}
    for entry in wf["jobs"]["images"]["strategy"]["matrix"]["include"]:
        plat = build["with"]["platforms"].replace("${{ matrix.platforms }}", entry["platforms"])
        out[entry["image"]] = {p.strip().removeprefix("linux/") for p in plat.split(",")}
    return out


@pytest.mark.parametrize("overlay", list(POOLS))
def test_each_pool_schedules_onto_its_gfd_labels_and_nowhere_else(rendered, overlay):
    js = _jobset(rendered[overlay])
    pool = POOLS[overlay]
    for stage in VLLM_STAGES:
        pod = _rj(js, stage)["template"]["spec"]["template"]["spec"]
        for other, spec in POOLS.items():
            for name in spec["nvml"]:
                fits = schedulable(pod, node(name, spec["gpus"], spec["arch"], spec["driver"]))
                assert fits == (other == overlay), (overlay, stage, name)
        # never on an older driver (the CUDA 13 images), nor where GFD sets no driver label
        labels = node(pool["nvml"][0], pool["gpus"], pool["arch"], 575)
        assert not schedulable(pod, labels)
        assert not schedulable(pod, {k: v for k, v in labels.items() if "driver" not in k})
        assert _gpus(pod) == pool["gpus"], (overlay, stage)  # a whole node: every GPU it has
    # training: on an 8-GPU x86-64 node, the pool's own where it is one (the train image is published
    # for amd64 only: a GB200 pool trains on an RTX PRO 6000, B200 or B300 node)
    train = _rj(js, "train")["template"]["spec"]["template"]["spec"]
    assert _gpus(train) == 8
    on = POOLS[overlay]["nvml"] if pool["arch"] == "amd64" else POOLS["full"]["nvml"] + POOLS["full-b200"]["nvml"]
    for name in on:
        assert schedulable(train, node(name, 8, "amd64", 580)), (overlay, name)
    assert not schedulable(train, node("NVIDIA GB200", 4, "arm64", 580))


@pytest.mark.parametrize("overlay", list(POOLS))
def test_each_pool_runs_images_published_for_its_architecture(rendered, overlay):
    js = _jobset(rendered[overlay])
    platforms = published_platforms()
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        req = (pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution"))
        if not req:
            continue  # the mirror and the guard: any node
        archs = {v for t in req["nodeSelectorTerms"] for e in t["matchExpressions"] if e["key"] == "kubernetes.io/arch"
                 for v in e["values"]}
        assert archs, (overlay, rj["name"])  # every GPU pod names its architecture
        for c in pod["containers"] + pod.get("initContainers", []):
            image = c["image"].split("/")[-1].split(":")[0].split("@")[0]
            assert archs <= platforms[image], (overlay, rj["name"], c["name"], image, archs)


def test_the_images_base_images_are_published_for_what_release_yml_builds():
    """An image is built for arm64 only where its base image is published for arm64: vllm/vllm-openai
    (vLLM's release step pushes vllm/vllm-openai:v<version>-x86_64 and -aarch64 and joins them in one
    manifest, `docker manifest create vllm/vllm-openai:v${RELEASE_VERSION} ...-x86_64 ...-aarch64`:
    vllm-project/vllm .buildkite/scripts/annotate-release.sh) and python; not pytorch/pytorch, published for
    linux/amd64 only."""
    base_archs = {"vllm/vllm-openai": {"amd64", "arm64"}, "python": {"amd64", "arm64"}, "pytorch/pytorch": {"amd64"}}
    for image, plats in published_platforms().items():
        base = re.search(r"^FROM (\S+)", (REPO / "images" / image / "Dockerfile").read_text(), re.M)[1].split(":")[0]
        assert plats <= base_archs[base], (image, base, plats)
    assert published_platforms()["capture"] == {"amd64", "arm64"}  # GB200's vLLM stages
    retrain = (REPO / ".github/workflows/retrain.yml").read_text()
    for image in ("capture", "extract"):  # CI's retrain builds what a GB200 pool runs, too
        block = retrain[retrain.index(f"file: images/{image}/Dockerfile"):]
        assert "platforms: linux/amd64,linux/arm64" in block[:400], image


@pytest.mark.parametrize("overlay", list(POOLS))
def test_each_pools_pods_are_what_its_recipe_plans(rendered, overlay):
    """Tensor parallelism = the GPUs of a vLLM pod = plan.gpus_per_node; pod counts = plan.capture_nodes and
    plan.extract_nodes = each worker's EAGLE_JOBS_NUM_SHARDS; training's GPUs = train.nproc_per_node."""
    docs = rendered[overlay]
    js, recipe = _jobset(docs), _recipe(docs)
    for stage in VLLM_STAGES:
        spec = _rj(js, stage)["template"]["spec"]
        args = getattr(recipe, stage).vllm.serve_args
        tp = int(args[args.index("--tensor-parallel-size") + 1])
        assert tp == _gpus(spec["template"]["spec"]) == recipe.plan.gpus_per_node, (overlay, stage)
        # PCIe: vLLM's custom all-reduce off (NCCL's all-reduce instead); the GB200 recipe keeps it on.
        # B200/B300 runs jobs/kimi-k2.5.yaml as it is: off there costs speed, not correctness
        assert ("--disable-custom-all-reduce" in args) == (overlay != "full-gb200"), (overlay, stage)
    for stage, nodes in (("capture", recipe.plan.capture_nodes), ("extract", recipe.plan.extract_nodes)):
        spec = _rj(js, stage)["template"]["spec"]
        env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0]["env"]}
        assert spec["completions"] == spec["parallelism"] == nodes == int(env["EAGLE_JOBS_NUM_SHARDS"]), \
            (overlay, stage)
    train = _rj(js, "train")["template"]["spec"]["template"]["spec"]
    assert recipe.train.nproc_per_node * recipe.train.nnodes == _gpus(train)
    plan = make_plan(recipe)
    for stage, est in plan["stages"].items():
        assert _rj(js, stage)["template"]["spec"]["activeDeadlineSeconds"] >= est["deadline_floor_s"], (overlay, stage)


def test_the_gb200_recipe_is_the_full_recipe_but_for_its_pool(rendered):
    full = yaml.safe_load((REPO / "jobs/kimi-k2.5.yaml").read_text())
    gb = yaml.safe_load((REPO / "jobs/kimi-k2.5-gb200.yaml").read_text())
    for stage in VLLM_STAGES:
        for r in (full, gb):
            r[stage]["vllm"].pop("serve_args")
    for k in ("name", "description", "plan"):
        full.pop(k, None)
        gb.pop(k)
    assert gb["store"].pop("run_id") == "kimi-k2.5-gb200" and full["store"].pop("run_id") == "kimi-k2.5"
    assert gb == full
    copy = REPO / "k8s/overlays/full-gb200/recipe.yaml"  # make k8s-recipes
    assert copy.read_text() == (REPO / "jobs/kimi-k2.5-gb200.yaml").read_text()


@pytest.mark.parametrize("overlay", list(POOLS))
def test_each_pool_is_admitted_by_both_jobset_versions(rendered, overlay):
    import jobset_admission

    js = _jobset(rendered[overlay])
    for version in jobset_admission.VERSIONS:
        assert jobset_admission.create_status(js, version) is None, (overlay, version)
