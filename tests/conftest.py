"""Shared fixtures: a real S3 API (moto's server on 127.0.0.1), stores, tiny models."""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
import yaml

# pytest's own `pytester` fixture: tests/test_tiers.py parses a command line as pytest does
pytest_plugins = ["pytester"]

sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton's interpreter runs speculators' fused-loss kernels on CPU tensors (test_train); triton reads
# this once, when it is imported, and torch/speculators import it early: so here, before any of them.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Two or three pytest-xdist workers, each with torch's OpenMP threads, and their children, share 2 cores:
# libgomp's threads spin at each barrier while the thread they wait for is descheduled, so that a
# 13-second test took 64 s beside one other test, and over 9 minutes late in a full run. PASSIVE: a
# waiting thread sleeps. libgomp reads it when it loads, so here, before torch; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Small multipart parts so tests exercise parallel multipart uploads.
os.environ.setdefault("EAGLE_JOBS_MULTIPART_BYTES", str(6 * 1024**2))
os.environ.setdefault("EAGLE_JOBS_PART_BYTES", str(5 * 1024**2))
os.environ.setdefault("EAGLE_JOBS_STORE_RETRIES", "3")

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def work_dir(tmp_path_factory):
    """Stage work dirs and vLLM server logs (EAGLE_JOBS_WORK_DIR, default ~/.cache/eagle-jobs/work/<run>)
    in this worker's own temp dir: many tests use run id "r", and on the default path two workers'
    servers appended to one log, so a failing test printed lines from another test's server."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE_JOBS_WORK_DIR", str(tmp_path_factory.mktemp("work")))
        yield


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """torch computes on one thread in the test process itself. Two or three workers already share the
    2 cores, and a second intra-op thread on small tensors only adds synchronisation: `make test-fast`
    took 171.6 s and 287 CPU-s so, against 190.6 s and 322 CPU-s (fresh .mypy_cache, one run after the
    other). Processes a test starts (stages, torchrun ranks, vLLM) keep their own threads."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def moto_server():
    """moto in server mode, as s3fs tests itself: a real HTTP S3 API on loopback."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env["AWS_ENDPOINT_URL"]
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def bucket(moto_server) -> str:
    import boto3

    name = f"b-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["file", "s3"])
def store_uri(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    b = request.getfixturevalue("bucket")
    return f"s3://{b}/runs"


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory) -> Path:
    from tiny_kimi import build_tiny_kimi

    return build_tiny_kimi(tmp_path_factory.mktemp("tiny-kimi"))


def kustomize(path: Path) -> list[dict]:
    """The documents `kubectl kustomize <path>` renders, parsed afresh for each caller (tests edit them).
    A directory of this repository renders once per test process: a dozen modules read the shipped overlays."""
    text = _kustomized(str(path)) if path.resolve().is_relative_to(REPO) else _run_kustomize(str(path))
    return [d for d in yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d]


@functools.cache
def _kustomized(path: str) -> str:
    return _run_kustomize(path)


def _run_kustomize(path: str) -> str:
    kubectl = shutil.which("kubectl")
    assert kubectl, ("kubectl not found: install kubectl >= 1.32 (kustomize 5.5 is built in), e.g. "
                     "apt-get install kubectl, or see https://kubernetes.io/docs/tasks/tools/")
    r = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True)
    assert r.returncode == 0, f"kubectl kustomize {path}: {r.stderr}"
    return r.stdout


def embedded_smollm2_except(dst: Path, name: str) -> Path:
    """dst holding links to every file of the embedded SmolLM2 but `name`, for a test to write its own;
    returns the source directory."""
    from eagle_jobs.recipe import EMBEDDED_SMOLLM2, VerifierSpec
    from eagle_jobs.verifier import resolve_path

    src = Path(resolve_path(VerifierSpec(model=EMBEDDED_SMOLLM2)))
    for f in src.iterdir():
        if f.name != name:
            (dst / f.name).symlink_to(f)
    return src


def write_prompts(path: Path, n: int = 12, multi_turn_every: int = 4) -> Path:
    import json

    subjects = ["the sea", "two plus two", "a fox", "photosynthesis", "numbers", "a poem", "the sky", "a dog"]
    lines = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Tell me about {subjects[i % len(subjects)]} #{i}"}]
        if multi_turn_every and i % multi_turn_every == 0:
            msgs += [{"role": "assistant", "content": "old answer"}, {"role": "user", "content": "And more?"}]
        lines.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_recipe(tmp_path, tiny_kimi):
    """A Kimi-shaped recipe on the tiny verifier, small enough for CPU tests."""
    from eagle_jobs.recipe import Recipe

    prompts = write_prompts(tmp_path / "prompts.jsonl")

    def make(**over):
        base = {
            "name": "tiny",
            "verifier": {"model": str(tiny_kimi)},
            "prompts": {"source": str(prompts), "validation": 2},
            "chat": {"reasoning_parser": "kimi_k2", "thinking": True},
            "sampling": {"temperature": 0.0, "max_new_tokens": 12},
            "limits": {"max_prompt_tokens": 200, "max_seq_len": 256},
            "aux_layer_ids": [1, 2, 3],
            "capture": {"backend": "transformers", "batch_size": 4, "prompts_per_shard": 4},
            "extract": {"backend": "transformers", "shard_bytes": 60_000, "batch_tokens": 256},
            # 4 heads x head_dim 32 = 128 on hidden 64: like Kimi-K2.5's 64 x 128 = 8192 on 7168, the
            # attention width is not the hidden size (the seed's head_dim 112 vs 128 pitfall)
            "draft": {"draft_vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
                      "head_dim": 32, "intermediate_size": 128},
            "train": {"epochs": 2, "lr": 1e-3, "optimizer": "adamw", "total_seq_len": 256, "ttt_steps": 2},
            "evaluate": {"backend": "transformers", "num_speculative_tokens": 2, "max_new_tokens": 10},
            "store": {"uri": f"file://{tmp_path}/store", "run_id": "t"},
        }
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(base.get(k), dict):
                base[k] = {**base[k], **v}
            else:
                base[k] = v
        return Recipe.model_validate(base)

    return make


def draft_and_batch(recipe, *attns, T=128):
    """Drafts with equal weights, one per attention implementation, built as run_train builds them,
    and a batch of two packed documents as speculators' collate makes it (after shift_batch)."""
    import torch

    from eagle_jobs.draft import build_draft_model, resolve_shape
    from eagle_jobs.verifier import load_config, text_config

    tcfg = text_config(load_config(recipe.verifier))
    shape = resolve_shape(recipe, tcfg)
    t2d = torch.zeros(shape.verifier_vocab_size, dtype=torch.bool)
    t2d[::2][: shape.draft_vocab_size] = True
    d2t = t2d.nonzero().squeeze(1) - torch.arange(shape.draft_vocab_size)
    torch.manual_seed(0)
    drafts = [build_draft_model(shape, recipe, tcfg, a, t2d, d2t) for a in attns]
    for d in drafts[1:]:
        d.load_state_dict(drafts[0].state_dict())
    H, n_aux, docs = shape.hidden_size, len(recipe.aux_layer_ids), (70, T - 70)
    batch = {"hidden_states": torch.randn(1, T, n_aux * H), "input_ids": torch.randint(0, 200, (1, T)),
             "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])[None],
             "loss_mask": (torch.rand(1, T) > 0.3).float(),
             "position_ids": torch.cat([torch.arange(1, n + 1) for n in docs])[None],
             "verifier_last_hidden_states": torch.randn(1, T, H)}
    return drafts, batch, draft_call_kwargs(recipe, "eager")


def draft_call_kwargs(recipe, loss_implementation: str) -> dict:
    """What speculators' Trainer passes to the draft's forward (ttt steps, the loss), as run_train sets it."""
    from eagle_jobs.draft import trainer_call_kwargs

    return trainer_call_kwargs(recipe, loss_implementation)[0]


# Test tiers (the Makefile's test-fast names the ones it leaves out; `make test` runs everything).
# index: resolves an image's dependency set with pip against the package index; read from the source.
# e2e: runs eagle-jobs end to end as its own processes (exit codes, signals, server lifetimes); marked per module.
# vllm: starts a real vLLM server; train: trains a draft (speculators' trainer, torchrun ranks);
# s3: talks to moto's S3 server; k8s: renders manifests with kustomize. s3 and k8s are marked from
# the fixtures and modules a test uses; train and index are read from the source; vllm is marked per module
# or per test, and the guard below fails a test that starts real vLLM without the marker, so the fast tier
# stays fast.
K8S_MODULES = {"test_k8s", "test_k8s_compare", "test_k8s_admission", "test_k8s_failure", "test_cluster",
               "test_workflow", "test_images", "test_guard", "test_k8s_pools", "test_qwen3_recipe"}
REAL_VLLM = {str(Path(sys.executable).parent / "vllm"), "eagle_jobs.vllm_cpu"}


# What trains a draft: a test whose body, or a fixture it uses, calls one of these (read from the source,
# so a new training test is in the `train` tier without anyone remembering to mark it).
TRAINS = re.compile(r"\brun_train\(|\brun_pipeline\(|\brun_streamed\(|\brun_compare\(|torch\.distributed\.run|"
                    r"\bspied_pod_main\(|"
                    r"[\"']train[\"'],\s*[\"']--recipe|[\"'](run|compare)[\"'],\s*[\"']--recipe")


# What reaches the package index: pip resolving a dependency set without installing it.
RESOLVES = re.compile(r"[\"']--dry-run[\"']")
# The tiers read from the source: a marker each, and what puts a test in it.
FROM_SOURCE = {"train": TRAINS, "index": RESOLVES}


def _tiers_from_source(item) -> set[str]:
    """The FROM_SOURCE tiers whose pattern the test's body, its fixtures', or a helper of its module they
    call (transitively) matches: one walk for every tier."""
    funcs = [getattr(item, "function", None)]
    for defs in getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).values():
        funcs += [d.func for d in defs]
    module = getattr(item, "module", None)
    seen: set = set()
    tiers: set[str] = set()
    while funcs and len(tiers) < len(FROM_SOURCE):
        f = funcs.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        found, called = _scan(f)
        tiers |= found
        funcs += [h for name in called if inspect.isfunction(h := getattr(module, name, None))
                  and h.__module__ == getattr(module, "__name__", None)]
    return tiers


@functools.cache
def _scan(f) -> tuple[frozenset[str], frozenset[str]]:
    """The FROM_SOURCE tiers f's source matches, and the plain names it calls (parsed once per function:
    collection asks this for every parameter of every test)."""
    import ast

    try:
        src = inspect.getsource(f)
    except (OSError, TypeError):
        return frozenset(), frozenset()
    found = frozenset(tier for tier, pattern in FROM_SOURCE.items() if pattern.search(src))
    try:
        tree = ast.parse(inspect.cleandoc(src) if src[0].isspace() else src)
    except SyntaxError:
        return found, frozenset()
    return found, frozenset(n.func.id for n in ast.walk(tree)
                            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))


def pytest_collection_modifyitems(config, items):
    for item in items:
        for tier in _tiers_from_source(item):
            item.add_marker(getattr(pytest.mark, tier))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if {"moto_server", "bucket"} & set(item.fixturenames) or params.get("store_uri") == "s3":
            item.add_marker(pytest.mark.s3)
        if item.module.__name__ in K8S_MODULES:
            item.add_marker(pytest.mark.k8s)
    # The costliest modules first: pytest-xdist (`--dist loadfile`) hands out whole modules (a module-scoped
    # server or trained draft is built once, on one worker) in this order, given --no-loadscope-reorder;
    # by default it reorders them by their number of tests (xdist/scheduler/loadscope.py, `schedule`),
    # which left the long, few-test modules to the end. (loadgroup cannot group here: pytest-xdist 3.8
    # marks a group by rewriting `item._nodeid`, which pytest 9.2's `nodeid`, read from `_id`, ignores.)
    cost = Counter()
    for item in items:
        cost[item.path] += _cost(item)
    items.sort(key=lambda item: -cost[item.path])  # stable: a module's own order stays


def _cost(item) -> int:
    """A rough weight: a real vLLM server 3, end to end or a training run 1, the rest 0 (the tiers above)."""
    if item.get_closest_marker("vllm"):
        return 3
    return 1 if item.get_closest_marker("e2e") or item.get_closest_marker("train") else 0


REFUSED_VLLM_EXIT = 97


@pytest.fixture(scope="session")
def vllm_refusal_bin(tmp_path_factory) -> Path:
    """A `vllm` first on PATH that refuses `serve` (exit 97, one line) and runs the real one otherwise:
    a stage started as a process of its own finds it as vllm_server.executable() would find vLLM."""
    bindir = tmp_path_factory.mktemp("vllm-refusal")
    real = Path(sys.executable).parent / "vllm"
    (bindir / "vllm").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = serve ]; then\n'
        '  echo "tests/conftest.py: real vLLM started outside the vllm tier by $EAGLE_JOBS_TEST_NODE:'
        ' mark it @pytest.mark.vllm" >&2\n'
        f"  exit {REFUSED_VLLM_EXIT}\n"
        "fi\n"
        f'exec "{real}" "$@"\n')
    (bindir / "vllm").chmod(0o755)
    return bindir


@pytest.fixture(autouse=True)
def _real_vllm_only_in_the_vllm_tier(request, monkeypatch, vllm_refusal_bin):
    import subprocess

    if request.node.get_closest_marker("vllm"):
        yield
        return
    # children too: a stage run as its own process (`eagle-jobs capture ...`) looks vLLM up on PATH, where
    # the refusing `vllm` comes first; a test that puts a stand-in `vllm` on PATH puts it before this one
    monkeypatch.setenv("PATH", f"{vllm_refusal_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("EAGLE_JOBS_TEST_NODE", request.node.nodeid)
    refused = REAL_VLLM | {str(vllm_refusal_bin / "vllm")}

    class Guarded(subprocess.Popen):
        def __init__(self, args, *a, **kw):
            argv = [str(x) for x in (args if isinstance(args, (list, tuple)) else [args])]
            if refused & set(argv) and "serve" in argv:
                raise AssertionError(f"{request.node.nodeid} starts real vLLM: mark it @pytest.mark.vllm")
            super().__init__(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", Guarded)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With EAGLE_JOBS_TEST_CPU_LOG set, one JSON line per test: its wall time and the CPU seconds it cost,
    the test process's own and its children's (those waited for), setup and teardown included. On 2 cores
    the suite's time is its CPU: this says where it goes, which --durations (wall, under contention) cannot."""
    path = os.environ.get("EAGLE_JOBS_TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> tuple[float, float]:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    t0, (s0, c0) = time.monotonic(), cpu()
    yield
    s1, c1 = cpu()
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"),
                            "end": round(time.time(), 1), "wall": round(time.monotonic() - t0, 1),
                            "self": round(s1 - s0, 1), "children": round(c1 - c0, 1)}) + "\n")


# -- the shipped overlays and the manifests shared by every run, rendered once a module (tests/test_k8s*.py) --
OVERLAYS = ["dev", "smoke", "full", "full-multinode", "qwen3-8b-1gpu"]
SHARED = ["cluster-setup", "dev-services"]  # applied once per cluster, never by a run


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: kustomize(REPO / "k8s/overlays" / o) for o in OVERLAYS}


@pytest.fixture(scope="module")
def shared_rendered() -> dict[str, list[dict]]:
    return {k: kustomize(REPO / "k8s" / k) for k in SHARED}


# -- the fake Kubernetes API server (tests/fake_kube.py) with k8s/cluster-setup applied, as an admin leaves it --
NS = "eagle-jobs"
JS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
PODS = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture
def kube(tmp_path):
    from fake_kube import FakeKube

    fake = FakeKube()
    url = fake.start()
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
           "clusters": [{"name": "fake", "cluster": {"server": url}}],
           "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "ci", "namespace": NS}}],
           "users": [{"name": "ci", "user": {"token": "t"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    admin_setup(fake)
    yield fake, str(path)
    fake.stop()


COLLECTIONS = {"Namespace": "/api/v1/namespaces", "ServiceAccount": f"/api/v1/namespaces/{NS}/serviceaccounts",
               "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles",
               "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings",
               "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies",
               "PriorityClass": "/apis/scheduling.k8s.io/v1/priorityclasses",
               "ValidatingAdmissionPolicy": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
               "ValidatingAdmissionPolicyBinding":
                   "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"}


def admin_setup(fake) -> None:
    """k8s/cluster-setup as an admin's `kubectl apply -k` leaves it: owned by kubectl's field manager."""
    for d in kustomize(REPO / "k8s/cluster-setup"):
        d["metadata"]["managedFields"] = [{"manager": "kubectl-client-side-apply", "operation": "Update"}]
        fake.put(COLLECTIONS[d["kind"]], d)
    fake.requests.clear()
