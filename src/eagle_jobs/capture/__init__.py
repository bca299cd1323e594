"""Stage 1, capture: the verifier regenerates every assistant turn of the prompt set.

A training row holds the exact token ids the verifier saw and produced
(prompt + completion, reasoning included), a loss mask that is 1 on generated
tokens only, and the parsed reasoning/content text for people. Rows of one
shard are one JSONL object in the store (docs/FORMAT.md#capture).
"""

from __future__ import annotations

from collections.abc import Callable

from eagle_jobs.capture.backends import (
    GenerationBackend,
    RequestSlots,
    ShardWork,
    TransformersBackend,
    VllmBackend,
)
from eagle_jobs.capture.rows import (
    Generation,
    ShardStats,
    Turn,
    make_row,
    parse_reasoning,
)
from eagle_jobs.committed import encode_rows
from eagle_jobs.layout import StageName
from eagle_jobs.progress import console, stage_progress
from eagle_jobs.prompts import Conversation, PromptRef, check_rejects, scan_prompts
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import CaptureFields, Row
from eagle_jobs.sampling import effective
from eagle_jobs.serve_plans import capture_plan
from eagle_jobs.sharding import ShardWorker, chunked
from eagle_jobs.store import Stage, Store

STAGE = StageName.CAPTURE.dir
SHARDS_AT_ONCE = 4  # capture loads and generates this many shards (at least 4x its concurrency) at a time


def run_capture(recipe: Recipe, store: Store, run_id: str, shard_index: int | None = None,
                num_shards: int | None = None) -> dict:
    stage = Stage(store, run_id, STAGE)
    prompts, rejects = scan_prompts(recipe.prompts)  # a PromptRef a conversation; messages loaded per shard
    convs = prompts.refs
    # what was skipped, and where, before deciding whether that is too much: the list is the fix
    stage.store.put_json(stage.key("rejects.json"), rejects.to_json())
    console.print(rejects.summary() + f" (list: {store.url(stage.key('rejects.json'))})", soft_wrap=True)
    check_rejects(recipe.prompts, convs, rejects)
    worker = ShardWorker.resolve(stage, shard_index, num_shards)
    idx, n = worker.index, worker.count
    chunks = chunked(worker.owned(convs), recipe.capture.prompts_per_shard)
    todo = worker.todo(chunks)
    console.print(f"{worker.describe()}: {sum(len(c) for c in chunks)} conversations in "
                  f"{len(chunks)} shards, {len(chunks) - len(todo)} already committed")
    from eagle_jobs.reuse import CaptureIndex

    index = CaptureIndex.build(store, recipe, run_id)  # rows other runs already captured
    totals = ShardStats()
    if todo:
        if recipe.capture.backend == "transformers":
            _capture_shards(recipe, worker, todo, lambda: TransformersBackend(recipe), totals, index, prompts.load)
        else:
            from eagle_jobs.vllm_server import server_log, vllm_endpoint

            needs_server = any(c.sha not in index.where for _k, chunk in todo for c in chunk)
            if needs_server:
                with vllm_endpoint(capture_plan(recipe), log=server_log(run_id, f"capture-{idx}")) as base:
                    _capture_shards(recipe, worker, todo, lambda: VllmBackend(recipe, base), totals, index,
                                    prompts.load)
            else:
                _capture_shards(recipe, worker, todo, lambda: None, totals, index, prompts.load)
    if totals.reused:
        console.print(f"  reused {totals.reused} conversations captured by other runs with the same settings")
    summary = {"worker": idx, "num_workers": n, "shards": len(chunks), "rows_written": totals.rows,
               "skipped_too_long": totals.skipped_too_long, "reused_conversations": totals.reused}
    if totals.skipped_too_long:
        console.print(f"  skipped {totals.skipped_too_long} turns longer than limits.max_prompt_tokens "
                      "or the server's max-model-len")
    worker.finish(summary)
    return summary


def _reused_rows(index, c: Conversation) -> list[Row] | None:
    rows = index.rows_for(c.sha)
    if rows is None:
        return None
    # the same conversation at another position of another prompt set
    moved = []
    for r in rows:
        m = r.copy()
        m["prompt_index"], m["split"], m["row_id"] = c.index, c.split, f"{c.index:08d}-{r['turn']:02d}"
        moved.append(m)
    return moved


def _capture_shards(recipe, worker: ShardWorker, todo: list[tuple[int, list[PromptRef]]],
                    make_backend: Callable[[], GenerationBackend | None], totals: ShardStats, index,
                    load: Callable[[list[PromptRef]], list[Conversation]]) -> None:
    """The shards of `todo`, SHARDS_AT_ONCE at a time: their conversations loaded (`load`), the ones other
    runs captured reused, the rest generated, each shard committed as it ends. A group at a time bounds
    the pod's memory by the group, not the prompt set; a group is several times the backend's concurrency,
    so its tail idles few request slots."""
    from eagle_jobs.reuse import capture_digest

    sampling = effective(recipe)
    with stage_progress("capture", sum(len(c) for _, c in todo), "conversations") as advance:
        def commit(k: int, chunk: list[Conversation], rows: list[Row], stats: ShardStats) -> None:
            advance(len(chunk), 0)
            rows.sort(key=lambda r: r["row_id"])
            blob, index = encode_rows(rows)
            name = worker.shard_name(k)
            tokens = sum(len(r["input_ids"]) for r in rows)
            fields: CaptureFields = {
                "rows": len(rows), "tokens": tokens, "row_index": index,
                "prompt_indices": [c.index for c in chunk], "prompt_sha256s": [c.sha for c in chunk],
                "skipped_too_long": stats.skipped, "reused_conversations": stats.reused,
                "settings_digest": capture_digest(recipe),
                "verifier": recipe.verifier.model, "backend": recipe.capture.backend,
                "sampling": sampling,  # the effective parameters, the same on either backend
            }
            worker.stage.commit_shard(name, {f"{name}.jsonl": blob}, fields)
            console.print(f"  committed {name}: {len(chunk)} conversations, {len(rows)} rows, {tokens:,} tokens",
                          soft_wrap=True, markup=False, highlight=False)
            totals.rows += len(rows)
            totals.skipped_too_long += stats.skipped_too_long
            totals.reused += stats.reused

        backend: GenerationBackend | None = None
        at_once = max(SHARDS_AT_ONCE, -(-4 * recipe.capture.concurrency // recipe.capture.prompts_per_shard))
        for g in range(0, len(todo), at_once):
            work = []  # shards with conversations to generate: (shard number, those conversations, stats)
            pending = {}  # shard number -> (all its conversations, rows other runs captured, stats)
            for k, refs in todo[g : g + at_once]:
                chunk = load(refs)
                stats = ShardStats()
                reused, fresh = [], []
                for c in chunk:
                    got = _reused_rows(index, c)
                    if got is None:
                        fresh.append(c)
                    else:
                        reused += got
                        stats.reused += 1
                if fresh:
                    work.append((k, fresh, stats))
                    pending[k] = (chunk, reused, stats)
                else:
                    commit(k, chunk, reused, stats)

            def finish(k: int, rows: list[Row], pending=pending) -> None:
                chunk, reused, stats = pending.pop(k)
                commit(k, chunk, reused + rows, stats)

            if work:
                backend = backend or make_backend()
                assert backend is not None, "a backend is made whenever a conversation is not reused"
                backend.run_shards(work, advance, finish)


__all__ = [
    "Generation",
    "GenerationBackend",
    "RequestSlots",
    "SHARDS_AT_ONCE",
    "STAGE",
    "ShardStats",
    "ShardWork",
    "TransformersBackend",
    "Turn",
    "VllmBackend",
    "make_row",
    "parse_reasoning",
    "run_capture",
]
