"""extract's two backends (records.HiddenStateBackend): transformers hooks in this process, and a vLLM
server's extract_hidden_states through its hidden-states connector's files."""

from __future__ import annotations

import asyncio
import fcntl
import math
import os
import time
from pathlib import Path

import torch

from eagle_jobs.errors import Unavailable
from eagle_jobs.poll import poll_until
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import Advance, Extracted, Row, RowStates


def _decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


class HookCapture:
    """Forward hooks that keep only the stored layers: inputs of aux layers, the final pre-norm output."""

    def __init__(self, model, aux: list[int]):
        self.model, self.aux = model, aux
        self.buf: dict[int, torch.Tensor] = {}
        layers = _decoder_layers(model)
        self.n = len(layers)
        self.handles = []
        for k in aux:
            self.handles.append(layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True))
        self.handles.append(layers[self.n - 1].register_forward_hook(self._post(self.n)))

    def _pre(self, k):
        def hook(_m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.buf[k] = x.detach()
        return hook

    def _post(self, k):
        def hook(_m, _args, out):
            self.buf[k] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.buf[k] for k in [*self.aux, self.n]], dim=2)  # [B, T, L, H]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def batches_by_tokens(rows: list[Row], batch_tokens: int) -> list[list[Row]]:
    out: list[list[Row]] = []
    cur: list[Row] = []
    for r in sorted(rows, key=lambda r: len(r["input_ids"])):
        if cur and (len(cur) + 1) * len(r["input_ids"]) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(r)
    if cur:
        out.append(cur)
    return out


def forward_batch(model, rows: list[Row], hook: HookCapture | None) -> list[torch.Tensor]:
    """One padded forward; per row its [T, L, H] states (right padding: real tokens first)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        att[i, : len(r["input_ids"])] = 1
    with torch.inference_mode():
        model.model(input_ids=ids, attention_mask=att, use_cache=False)  # the trunk: no lm_head
    if hook is None:
        return []
    st = hook.stacked()
    return [st[i, : len(r["input_ids"])] for i, r in enumerate(rows)]


class TransformersExtractor:
    def __init__(self, recipe: Recipe):
        from eagle_jobs.verifier import load_verifier

        self.recipe = recipe
        self.v = load_verifier(recipe.verifier)
        self.hook = HookCapture(self.v.model, recipe.aux_layer_ids)

    def states(self, rows: list[Row], advance: Advance) -> Extracted:
        """row_id -> its [T, L, H] states and the token ids they are for."""
        out = Extracted({}, {})
        for b in batches_by_tokens(rows, self.recipe.extract.batch_tokens):
            for r, hs in zip(b, forward_batch(self.v.model, b, self.hook)):
                out.states[r["row_id"]] = RowStates(hs, r["input_ids"])
            advance(len(b), sum(len(r["input_ids"]) for r in b))
        return out

    def close(self) -> None:
        self.hook.remove()


class VllmExtractor:
    """vLLM's extract_hidden_states + its hidden-states connector writing to local scratch.

    The connector's protocol (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py):
    `<path>.lock` is created and held with LOCK_EX before the response names `<path>`; a writer thread
    saves the file afterwards and then releases the lock. So: wait for LOCK_SH first, read, delete.
    """

    def __init__(self, recipe: Recipe, base_url: str, scratch: Path):
        self.recipe, self.base, self.scratch = recipe, base_url, scratch

    @staticmethod
    def wait_written(path: Path, timeout_s: float, poll_s: float = 0.01) -> None:
        """Until the connector's writer has released `<path>.lock` (polled, as speculators' client does)."""
        lock = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + timeout_s
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # use_synchronization_lock off: the file is complete when it exists

        def released() -> bool | None:
            if fd is None:
                return path.is_file() or None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return None

        def failed() -> None:
            if time.monotonic() > deadline:
                raise Unavailable(f"hidden-states file {path}: still locked by vLLM after {timeout_s:.0f}s "
                                  "(extract.vllm.request_timeout_s); is the server's writer stuck? rerun to retry")

        try:
            poll_until(released, failed=failed, every_s=poll_s, report_s=math.inf, progress=False)
        finally:
            if fd is not None:
                os.close(fd)

    @staticmethod
    def _load(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file

        d = load_file(str(path))
        return d["hidden_states"], d["token_ids"]

    @staticmethod
    def remove(path: Path) -> None:
        for p in (path, path.with_name(path.name + ".lock")):
            p.unlink(missing_ok=True)

    def states(self, rows: list[Row], advance: Advance) -> Extracted:
        import httpx

        from eagle_jobs.vllm_server import post_with_retries

        spec = self.recipe.extract

        async def one(client, model, sem, r, out):
            body = {"model": model, "prompt": r["input_ids"], "max_tokens": 1, "return_token_ids": True}
            async with sem:
                resp = await post_with_retries(client, f"{self.base}/v1/completions", body, spec.vllm.max_retries)
            echoed = resp["choices"][0].get("prompt_token_ids") or resp.get("prompt_token_ids")
            where = (resp.get("kv_transfer_params") or {}).get("hidden_states_path")
            if not where:
                raise Unavailable(f"vLLM at {self.base} answered without kv_transfer_params.hidden_states_path: "
                                  "is it serving with extract's --speculative-config and --kv-transfer-config?")
            path = Path(where)
            # wait even when the answer is unusable: deleting a lock vLLM still holds leaves its file behind
            await asyncio.to_thread(self.wait_written, path, spec.vllm.request_timeout_s)
            try:
                if echoed != r["input_ids"]:
                    out.problems[r["row_id"]] = "echoed token ids differ from the row"
                    return
                if not path.is_file():
                    raise Unavailable(f"vLLM released {path}.lock without writing {path}: see the server log")
                hs, tids = await asyncio.to_thread(self._load, path)
                out.states[r["row_id"]] = RowStates(hs, tids.tolist())
            finally:
                self.remove(path)
            advance(1, len(r["input_ids"]))

        async def main() -> Extracted:
            out = Extracted({}, {})
            async with httpx.AsyncClient(timeout=httpx.Timeout(spec.vllm.request_timeout_s, connect=30)) as client:
                m = await client.get(f"{self.base}/v1/models")
                model = m.json()["data"][0]["id"]
                sem = asyncio.Semaphore(spec.concurrency)
                await asyncio.gather(*(one(client, model, sem, r, out) for r in rows))
            return out

        return asyncio.run(main())

    def close(self) -> None:
        pass


def sweep_scratch(scratch: Path) -> int:
    """Delete what an earlier, failed attempt left in this worker's scratch: files whose lock nobody holds."""
    removed = 0
    files = {p.with_name(p.name.removesuffix(".lock")) for p in scratch.glob("*.safetensors*")}
    for path in sorted(files):
        lock = path.with_name(path.name + ".lock")
        if lock.exists():
            with open(lock) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a write in flight
        VllmExtractor.remove(path)
        removed += 1
    return removed
