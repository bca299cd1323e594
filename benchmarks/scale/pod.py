"""One pod of the scale rehearsal (benchmarks/scale/rehearse.py): a stage's own code at the recipe's row,
shard and object counts, with the model maths replaced.

    python benchmarks/scale/pod.py <capture|extract|train|evaluate|status> <recipe.json> <run-id> [worker]

What is replaced, and nothing else:
- capture: the generation backend (SyntheticGeneration): a conversation's answer is random token ids of a
  length drawn from the recipe's completion budget, scaled by the rehearsal's token scale;
- extract: the hidden-state backend (SyntheticStates): zeros of the stored shape (the config's hidden size);
- train: the optimizer step (none: the pod builds the rank's data index, sampler and stream feed, walks
  every step of epoch 0 through the feed's checkpoint schedule and marks what a checkpoint would consume).
Everything else (prompt reading, the shard plans, the reuse indexes, commits, manifests, the stream
window and its markers) is the stage's code as a pod runs it. The heartbeat file is EAGLE_JOBS_HEARTBEAT.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from eagle_jobs.recipe import Recipe
from eagle_jobs.records import Extracted, Row, RowStates
from eagle_jobs.store import Store

TOKEN_SCALE = float(os.environ.get("REHEARSAL_TOKEN_SCALE", "1"))  # rows hold this share of the real tokens
STEADY_SHARDS = int(os.environ.get("REHEARSAL_STEADY_SHARDS", "0"))  # extract: at most this many (0: all)


class SyntheticGeneration:
    """capture's GenerationBackend: answers of a length drawn between a quarter of and the whole of
    sampling.max_new_tokens (thinking traces; the plan prices every answer at the whole), prompts of
    their text's length at about four characters a token, both times TOKEN_SCALE."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def run_shards(self, work, advance, done) -> None:
        for key, convs, _stats in work:
            done(key, [self._row(c, advance) for c in convs])

    def _row(self, c, advance) -> Row:
        from eagle_jobs.capture import Generation, Turn, make_row

        rnd = random.Random(c.index)
        chars = sum(len(str(m.get("content", ""))) for m in c.messages)
        n_prompt = max(1, int(min(chars / 4 + 32, self.recipe.limits.max_prompt_tokens) * TOKEN_SCALE))
        budget = self.recipe.sampling.max_new_tokens
        n_comp = max(1, int(rnd.randint(budget // 4, budget) * TOKEN_SCALE))
        prompt = [rnd.randrange(100, 30000) for _ in range(n_prompt)]
        comp = [rnd.randrange(100, 30000) for _ in range(n_comp)]
        advance(0, n_comp)
        text = " ".join(str(m.get("content", "")) for m in c.messages)[: n_comp * 4]
        return make_row(self.recipe, Turn(c, 0, []), Generation(prompt, comp, None, text, "length"))


class SyntheticStates:
    """extract's HiddenStateBackend: zeros of [T, layers, hidden] per row (the bytes' count is the stage's)."""

    def __init__(self, recipe: Recipe, layers: int, hidden: int):
        self.layers, self.hidden = layers, hidden

    def states(self, rows: list[Row], advance) -> Extracted:
        out = Extracted({}, {})
        for r in rows:
            n = len(r["input_ids"])
            out.states[r["row_id"]] = RowStates(torch.zeros(n, self.layers, self.hidden), r["input_ids"])
            advance(1, n)
        return out

    def close(self) -> None:
        pass


def capture(recipe: Recipe, store: Store, run_id: str, worker: int, workers: int) -> dict:
    from eagle_jobs import capture as cap

    cap.TransformersBackend = SyntheticGeneration  # type: ignore[misc,assignment]
    return cap.run_capture(recipe.model_copy(update={"capture": recipe.capture.model_copy(
        update={"backend": "transformers"})}), store, run_id, worker, workers)


def extract(recipe: Recipe, store: Store, run_id: str, worker: int, workers: int) -> dict:
    from eagle_jobs import extract as ex
    from eagle_jobs.draft import stored_layer_ids
    from eagle_jobs.verifier import load_config, text_config

    tcfg = text_config(load_config(recipe.verifier))
    layers = len(stored_layer_ids(recipe.aux_layer_ids, int(tcfg.num_hidden_layers)))
    ex.TransformersExtractor = lambda r: SyntheticStates(r, layers, int(tcfg.hidden_size))  # type: ignore
    real = ex._extract_shards

    def steady(run, todo, make_extractor):  # the first STEADY_SHARDS of the plan: the per-shard costs
        return real(run, todo[:STEADY_SHARDS] if STEADY_SHARDS else todo, make_extractor)

    ex._extract_shards = steady  # type: ignore[assignment]
    return ex.run_extract(recipe.model_copy(update={"extract": recipe.extract.model_copy(
        update={"backend": "transformers"})}), store, run_id, worker, workers)


def train(recipe: Recipe, store: Store, run_id: str, _worker: int, _workers: int) -> dict:
    from eagle_jobs.heartbeat import beat
    from eagle_jobs.train.data import TrainData, vocab_mapping
    from eagle_jobs.train.run import check_extraction

    info, _tcfg, shape = check_extraction(recipe, store, run_id)
    beat(force=True)
    t0 = time.monotonic()
    _d2t, _t2d, coverage = vocab_mapping(info, store, run_id, shape, Path(os.environ["REHEARSAL_WORK"]))
    vocab_s = time.monotonic() - t0
    beat(force=True)
    data = TrainData.create(recipe, store, run_id, info, shape, Path(os.environ["REHEARSAL_WORK"]),
                            torch.float32)
    beat(force=True)
    feed = data.feed
    steps = checkpoints = 0
    if feed is not None:
        batches = feed.sampler._generate_batches(0)  # type: ignore[attr-defined]
        for step in range(1, len(batches) + 1):
            steps += 1
            if feed.checkpoint_due(0, step):  # a checkpoint: what it would mark consumed, marked
                checkpoints += 1
                feed.on_commit(0, step)
            beat()
    return {"train_samples": len(data.items["train"]), "steps_epoch0": steps, "checkpoints_epoch0": checkpoints,
            "vocab_mapping_s": round(vocab_s, 1), "vocab_coverage": round(coverage, 4)}


def evaluate(recipe: Recipe, _store: Store, _run_id: str, _worker: int, _workers: int) -> dict:
    from eagle_jobs.evaluate.sets import eval_sets
    from eagle_jobs.heartbeat import beat

    sets = eval_sets(recipe)
    beat(force=True)  # the stage's first progress comes after its sets are built: this is the time to it
    return {name: len(s) for name, s in sets.items()}


def status(_recipe: Recipe, store: Store, run_id: str, _worker: int, _workers: int) -> dict:
    from eagle_jobs.cluster.follow import store_progress

    return {"progress": str(store_progress(store, run_id))[:200]}


ROLES = {"capture": capture, "extract": extract, "train": train, "evaluate": evaluate, "status": status}


def main() -> None:
    role, recipe_file, run_id = sys.argv[1:4]
    worker, workers = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0, 1)
    recipe = Recipe.model_validate(json.loads(Path(recipe_file).read_text()))
    store = Store.open(recipe.store.uri)
    out = ROLES[role](recipe, store, run_id, worker, workers)
    print("REHEARSAL-RESULT " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
