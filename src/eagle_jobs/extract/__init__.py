"""Stage 2, extract: the verifier's hidden states for every committed capture row.

Defined exactly as vLLM's `extract_hidden_states` defines them: aux id k is the
input of decoder layer k (HF `hidden_states[k]`), and the stored final entry is
the last decoder layer's output before the final norm (vLLM's id N). Stored in
bf16 (or fp8 e4m3 with per-token scales) in shards of about
`extract.shard_bytes` (docs/FORMAT.md#hidden-state-shards).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from eagle_jobs.committed import RowRef, load_rows, read_sample, row_index
from eagle_jobs.draft import check_aux_ids, stored_layer_ids
from eagle_jobs.extract.backends import (  # noqa: F401 - the backends, where callers import them
    HookCapture,
    TransformersExtractor,
    VllmExtractor,
    batches_by_tokens,
    forward_batch,
    sweep_scratch,
)
from eagle_jobs.hsformat import Sample, bytes_per_token, encode_shard, resolve_storage, sample_problem
from eagle_jobs.layout import StageName
from eagle_jobs.progress import console, stage_progress
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import (
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
    streamed = stream.StreamPlan(rows, bpt, recipe.extract.shard_bytes, worker.count, passes)
    shards = streamed.worker(worker.index)
    by_id = {r.row_id: r for r in rows}
    todo = [(s.name, [by_id[i] for i in s.row_ids]) for s in stream.unfinished(worker.stage, shards)]
    window = stream.Window(worker.stage.store, worker.stage.run_id, recipe.store.window_bytes or 0,
                           streamed.order)
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
