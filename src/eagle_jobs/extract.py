"""Stage 2, extract: the verifier's hidden states for every committed capture row.

Defined exactly as vLLM's `extract_hidden_states` defines them: aux id k is the
input of decoder layer k (HF `hidden_states[k]`), and the stored final entry is
the last decoder layer's output before the final norm (vLLM's id N). Stored in
bf16 (or fp8 e4m3 with per-token scales) in shards of about
`extract.shard_bytes` (docs/FORMAT.md#hidden-state-shards).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from eagle_jobs.committed import RowRef, load_rows, read_sample, row_index
from eagle_jobs.draft import check_aux_ids, stored_layer_ids
from eagle_jobs.errors import Unavailable
from eagle_jobs.hsformat import Sample, bytes_per_token, encode_shard, resolve_storage, sample_problem
from eagle_jobs.layout import StageName
from eagle_jobs.progress import console, stage_progress
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import (
    Advance,
    Extracted,
    ExtractFields,
    HiddenStateBackend,
    Row,
    RowStates,
    SampleEntry,
    Skipped,
)
from eagle_jobs.serve_plans import extract_plan, extract_scratch
from eagle_jobs.sharding import ShardWorker, plan_shards
from eagle_jobs.store import Stage, Store
from eagle_jobs.verifier import load_config, text_config

if TYPE_CHECKING:
    from eagle_jobs.reuse import HiddenStateIndex

STAGE = StageName.EXTRACT.dir


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
        try:
            while True:
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        return
                    except BlockingIOError:
                        pass
                elif path.is_file():
                    return
                if time.monotonic() > deadline:
                    raise Unavailable(f"hidden-states file {path}: still locked by vLLM after {timeout_s:.0f}s "
                                      "(extract.vllm.request_timeout_s); is the server's writer stuck? rerun to retry")
                time.sleep(poll_s)
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


def run_extract(recipe: Recipe, store: Store, run_id: str, shard_index: int | None = None,
                num_shards: int | None = None) -> dict:
    tcfg = text_config(load_config(recipe.verifier))
    n_layers, hidden = int(tcfg.num_hidden_layers), int(tcfg.hidden_size)
    check_aux_ids(recipe.aux_layer_ids, n_layers)  # before any weights load
    layer_ids = stored_layer_ids(recipe.aux_layer_ids, n_layers)
    stage = Stage(store, run_id, STAGE)
    rows = row_index(store, run_id)  # planning needs lengths and splits; tokens are read a shard at a time
    x = recipe.extract
    recipe = recipe.with_storage(resolve_storage(x.storage_dtype, sum(r.num_tokens for r in rows),
                                                 len(layer_ids), hidden, x.fp8_above_bytes))
    worker = ShardWorker.resolve(stage, shard_index, num_shards)
    idx, n = worker.index, worker.count
    bpt = bytes_per_token(len(layer_ids), hidden, recipe.extract.storage_dtype)
    plan, todo, before_shard = shard_plan(recipe, worker, rows, bpt)
    console.print(f"{worker.describe()}: {sum(len(s) for s in plan)} rows in {len(plan)} shards "
                  f"(~{recipe.extract.shard_bytes / 2**20:.0f} MiB each, {recipe.extract.storage_dtype} states, "
                  f"{bpt} B/token), "
                  f"{len(plan) - len(todo)} already committed; layers {layer_ids}")
    from eagle_jobs.reuse import HiddenStateIndex

    run = ShardRun(recipe, worker, layer_ids, hidden, bpt, before_shard,
                   HiddenStateIndex.build(store, recipe, run_id))  # samples other runs already extracted
    if todo:
        if recipe.extract.backend == "transformers":
            _extract_shards(run, todo, lambda: TransformersExtractor(recipe))
        else:
            from eagle_jobs.vllm_server import server_log, vllm_endpoint

            scratch = extract_scratch(recipe, run_id, idx)
            if swept := sweep_scratch(scratch):
                console.print(f"  removed {swept} hidden-state files an earlier attempt left in {scratch}")
            with vllm_endpoint(extract_plan(recipe, run_id, idx), log=server_log(run_id, f"extract-{idx}")) as base:
                _extract_shards(run, todo, lambda: VllmExtractor(recipe, base, scratch))
    skipped = run.skipped
    if run.reused:
        console.print(f"  reused {run.reused} samples extracted by other runs with the same settings")
    if skipped:
        console.print(f"  [yellow]skipped {len(skipped)} records[/] (never trained on): "
                      + "; ".join(f"{s['row_id']}: {s['reason']}" for s in skipped[:5]))
    summary = {"worker": idx, "num_workers": n, "shards": len(plan), "skipped": len(skipped),
               "layer_ids": layer_ids, "reused_samples": run.reused}
    worker.finish(summary)
    return summary


def shard_plan(recipe: Recipe, worker: ShardWorker, rows: list[RowRef], bpt: int
               ) -> tuple[list[list[RowRef]], list[tuple[str, list[RowRef]]], Callable[[str, int], None]]:
    """This worker's shards, the (name, rows) still to commit, and what to do before computing one.

    Stored: the worker's rows by length. Stream: the stream's order (eagle_jobs.stream), skipping
    shards training has finished with as well, and waiting while the window is full.
    """
    if recipe.train.source != "stream":
        plan = plan_shards(worker.owned(rows), bpt, recipe.extract.shard_bytes)
        return plan, [(worker.shard_name(k), s) for k, s in worker.todo(plan)], lambda _n, _b: None
    from eagle_jobs import stream

    passes = recipe.train.epochs if recipe.train.later_epochs == "re-extract" else 1
    shards = stream.worker_stream(rows, bpt, recipe.extract.shard_bytes, worker.index, worker.count, passes)
    by_id = {r.row_id: r for r in rows}
    store, run_id = worker.stage.store, worker.stage.run_id
    todo = [(s.name, [by_id[i] for i in s.row_ids]) for s in stream.unfinished(worker.stage, shards)]
    order = stream.stream_order(rows, bpt, recipe.extract.shard_bytes, worker.count, passes)
    window = stream.Window(store, run_id, recipe.store.window_bytes or 0, order)
    return [[by_id[i] for i in s.row_ids] for s in shards], todo, window.wait


@dataclass
class ShardRun:
    """One extract worker's run: what every shard is computed with (the recipe with its storage dtype
    resolved, the stored layers, bytes per token, the wait before a shard, the index of states other runs
    extracted), and what it found (rows skipped, samples reused)."""

    recipe: Recipe
    worker: ShardWorker
    layer_ids: list[int]
    hidden: int
    bytes_per_token: int
    before_shard: Callable[[str, int], None]
    index: HiddenStateIndex
    skipped: list[Skipped] = field(default_factory=list)
    reused: int = 0


def _extract_shards(run: ShardRun, todo: list[tuple[str, list[RowRef]]],
                    make_extractor: Callable[[], HiddenStateBackend]) -> None:
    """Compute shard k+1 while shard k is packed and uploaded in the background."""
    from eagle_jobs.reuse import ids_sha256

    recipe, worker, index, skipped_all = run.recipe, run.worker, run.index, run.skipped
    pool = ThreadPoolExecutor(max_workers=1)
    pending: Future | None = None
    ex: HiddenStateBackend | None = None
    try:
        with stage_progress("extract", sum(len(s) for _, s in todo), "rows") as advance:
            for name, refs in todo:
                run.before_shard(name, sum(r.num_tokens for r in refs) * run.bytes_per_token)
                rows = load_rows(worker.stage.store, worker.stage.run_id, refs)  # this shard's rows only
                got, fresh = Extracted({}, {}), []
                for r in rows:
                    hit = index.where.get(ids_sha256(r["input_ids"]))
                    if hit is None:
                        fresh.append(r)
                        continue
                    src_run, m, e = hit
                    s = read_sample(worker.stage.store, src_run, m, e, torch.float32)
                    got.states[r["row_id"]] = RowStates(s["hidden_states"], s["token_ids"].tolist())
                    run.reused += 1
                    advance(1, 0)
                if fresh:
                    ex = ex or make_extractor()
                    new = ex.states(fresh, advance)
                    got.states.update(new.states)
                    got.problems.update(new.problems)
                if pending is not None:
                    skipped_all.extend(pending.result())
                pending = pool.submit(_pack_and_commit, recipe, worker.stage, name, rows, got,
                                      run.layer_ids, run.hidden)
            if pending is not None:
                skipped_all.extend(pending.result())
    finally:
        pool.shutdown(wait=True)
        if ex is not None:
            ex.close()


def _pack_and_commit(recipe, stage: Stage, name: str, rows: list[Row], got: Extracted, layer_ids,
                     hidden) -> list[Skipped]:
    samples, kept, skipped = [], [], []
    for r in rows:
        st = got.states.get(r["row_id"])
        problem = got.problems.get(r["row_id"]) or ("missing" if st is None else sample_problem(
            st.hidden_states, st.token_ids, r["input_ids"], len(layer_ids), hidden))
        if problem or st is None:
            skipped.append(Skipped(row_id=r["row_id"], reason=problem or "missing"))
            continue
        samples.append(Sample(r["row_id"], st.hidden_states, torch.tensor(r["input_ids"]),
                              torch.tensor(r["loss_mask"])))
        kept.append(r)
    blob, index = encode_shard(samples, layer_ids, recipe.extract.storage_dtype)
    from eagle_jobs.reuse import extract_digest, ids_sha256

    for e, r in zip(index, kept):
        e["ids_sha256"] = ids_sha256(r["input_ids"])
        e["split"] = r["split"]
        e["prompt_index"] = r["prompt_index"]
        e["loss_tokens"] = int(sum(r["loss_mask"]))
    tokens = sum(e["num_tokens"] for e in index)
    fields: ExtractFields = {
        "format": "eagle-jobs/hidden-states/v1", "storage": recipe.extract.storage_dtype,
        "layer_ids": layer_ids, "hidden_size": hidden, "samples": cast(list[SampleEntry], index), "skipped": skipped,
        "verifier": recipe.verifier.model, "tokens": tokens,
        "settings_digest": extract_digest(recipe),
    }
    stage.commit_shard(name, {f"{name}.safetensors": blob}, fields)
    console.print(f"  committed {name}: {len(index)} samples, {tokens:,} tokens, "
                  f"{len(blob) / 2**20:,.1f} MiB", soft_wrap=True, markup=False, highlight=False)
    return skipped
