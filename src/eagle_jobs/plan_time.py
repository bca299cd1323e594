"""The one time model of a run: how long capture, extraction and training take at the recipe's stated rates,
stored or streamed. `eagle-jobs plan` prices the recipe's own corpus with it (plan.make_plan), `plan --scale`
corpora the size the anchors trained on (plan_scale).

Training's epoch is its compute or its store reads, whichever is slower (an epoch is re-read from the store
unless the corpus fits train.local_stage_bytes); streamed, its first epoch starts once each extraction pod has
committed a shard (the lead) and cannot end before extraction's pass does.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle_jobs.recipe import Recipe, Throughputs

SCALE_MODES = {
    "stored": "today: extraction writes the whole corpus before training starts, training re-reads it every epoch",
    "streaming": "training reads shards as extraction commits them (the first epoch overlaps extraction); "
                 "the shards stay for later epochs",
    "re-extract": "streaming through a bounded window: every epoch extraction runs again (prefill only, no "
                  "generation) and training deletes the shards it has read",
}

@dataclass(frozen=True)
class ScaleBasis:
    """What one conversation costs under a recipe, and the rates and sizes it is priced at."""

    samples_per_conversation: float
    tokens_per_sample: float  # an upper bound: every answer runs to sampling.max_new_tokens
    answer_tokens_per_sample: int
    bytes_per_token: dict[str, int]  # by storage dtype
    storage: str  # extract.storage_dtype: auto picks per corpus (hsformat.resolve_storage)
    fp8_above_bytes: int
    epochs: int
    train_nodes: int
    train_gpus: int
    local_stage_bytes: int
    shard_bytes: int
    window_bytes: int
    rates: Throughputs


@dataclass(frozen=True)
class Spans:
    """Wall seconds of capture, of one extraction pass, of training's compute per epoch and of its first and
    each later epoch (compute or store reads, whichever is slower), and the lead before streaming training
    can start (one shard per extraction pod committed)."""

    capture: float
    extract: float
    compute: float
    first_epoch: float
    later_epoch: float
    lead: float


@dataclass(frozen=True)
class ModeCost:
    """Seconds the extraction and training pods are booked, extraction passes, and hidden-state bytes."""

    extract_span: float
    train_span: float
    passes: int
    peak: int
    written: int
    reads: int


def time_basis(recipe: Recipe, samples_per_conversation: float, tokens_per_sample: float,
               bytes_per_token: dict[str, int]) -> ScaleBasis:
    """What one conversation costs under `recipe`, and the recipe's rates and sizes."""
    t = recipe.train
    window = recipe.store.window_bytes or recipe.plan.stream_window_bytes
    return ScaleBasis(samples_per_conversation=samples_per_conversation, tokens_per_sample=tokens_per_sample,
                      answer_tokens_per_sample=recipe.sampling.max_new_tokens, bytes_per_token=bytes_per_token,
                      storage=recipe.extract.storage_dtype, fp8_above_bytes=recipe.extract.fp8_above_bytes,
                      epochs=t.epochs, train_nodes=t.nnodes, train_gpus=t.nproc_per_node * t.nnodes,
                      local_stage_bytes=t.local_stage_bytes, shard_bytes=recipe.extract.shard_bytes,
                      window_bytes=window, rates=recipe.plan)


def _later_reads(b: ScaleBasis, corpus: int) -> int:
    return corpus if corpus > b.local_stage_bytes else 0  # a corpus that fits is staged once, on local disk


def spans(b: ScaleBasis, samples: float, tokens: int, corpus: int) -> Spans:
    r = b.rates
    extract = (tokens / r.extract_tokens_per_s + corpus / r.store_bytes_per_s) / r.extract_nodes  # prefill, writes
    compute = samples / (r.train_samples_per_s_per_gpu * b.train_gpus)
    read_rate = r.store_bytes_per_s * b.train_nodes
    return Spans(capture=samples * b.answer_tokens_per_sample / (r.capture_tokens_per_s * r.capture_nodes),
                 extract=extract, compute=compute, first_epoch=max(compute, corpus / read_rate),
                 later_epoch=max(compute, _later_reads(b, corpus) / read_rate),
                 lead=extract * min(1.0, b.shard_bytes * r.extract_nodes / max(1, corpus)))


def mode_cost(b: ScaleBasis, s: Spans, corpus: int, mode: str) -> ModeCost:
    ep, later = b.epochs, (b.epochs - 1) * s.later_epoch
    reads = corpus + (ep - 1) * _later_reads(b, corpus)
    if mode == "stored":
        return ModeCost(s.extract, s.first_epoch + later, 1, corpus, corpus, reads)
    if mode == "streaming":  # the first epoch ends when both the extraction and its own reading have
        return ModeCost(s.extract, max(s.extract, s.lead + s.first_epoch) + later, 1, corpus, corpus, reads)
    if mode == "re-extract":  # every epoch is a streamed pass; extraction pods wait while the window is full
        span = ep * max(s.extract, s.lead + s.first_epoch)
        peak = min(corpus, b.window_bytes + b.rates.extract_nodes * b.shard_bytes)
        return ModeCost(span, span, ep, peak, ep * corpus, ep * corpus)
    raise ValueError(f"unknown data mode {mode!r} (one of {', '.join(SCALE_MODES)})")


def recipe_mode(recipe: Recipe) -> str:
    """The data mode a recipe runs: stored, streaming, or re-extract (SCALE_MODES)."""
    t = recipe.train
    if t.source != "stream":
        return "stored"
    return "re-extract" if t.later_epochs == "re-extract" else "streaming"
