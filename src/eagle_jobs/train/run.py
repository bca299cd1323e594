"""The train stage's entry, `run_train`, reading top to bottom: check the extraction against the recipe,
resolve the draft shape, build the vocab mapping from loss-masked token counts, stage the shards, build
the model and loaders, train (checkpoints committed to the store every epoch, every
train.checkpoint_every_minutes and on SIGTERM, resuming from the newest at its exact step), export the
chosen epoch's checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from eagle_jobs.committed import extraction_info, row_index
from eagle_jobs.draft import (
    DraftShape,
    build_draft_model,
    loss_implementation,
    optimizer_settings,
    resolve_shape,
    stored_layer_ids,
    trainer_call_kwargs,
)
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.layout import StageName, train_dir
from eagle_jobs.progress import console
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import CheckpointManifest, ExtractionInfo, TrainRecord
from eagle_jobs.settings import settings
from eagle_jobs.store import Stage, Store
from eagle_jobs.train.checkpoints import (
    commit_checkpoint,
    export_selected,
    prune_local_checkpoints,
    prune_step_checkpoints,
    resume_checkpoint,
)
from eagle_jobs.train.launch import launch_ranks
from eagle_jobs.verifier import load_config, text_config

if TYPE_CHECKING:  # the data module imports speculators: run_train imports it once it trains
    from eagle_jobs.train.data import TrainData

STAGE = StageName.TRAIN.dir


def run_train(recipe: Recipe, store: Store, run_id: str, max_steps: int | None = None,
              work_dir: Path | None = None, variant: str | None = None) -> TrainRecord:
    """Train the run's draft on its committed extraction (or, with `variant`, one arm of `compare`)."""
    # 1. the extraction must be the one this draft expects
    info, tcfg, shape = check_extraction(recipe, store, run_id)
    work = Path(work_dir or settings().work_root()) / run_id
    if variant is not None:
        work = work / train_dir(variant)
    started = time.time()
    launched = launch_ranks(recipe, store, run_id, max_steps, work, variant)  # world size > 1: torchrun's ranks
    if launched is not None:
        return launched
    # speculators (about 8 s of imports) only here, in the process that trains: torchrun's launcher above
    # starts the ranks without it (the data module imports it too)
    from speculators.train.distributed import maybe_destroy_distributed

    from eagle_jobs.train.data import TrainData, vocab_mapping

    # 2. this rank: speculators adapted, the device's attention, loss and state dtype
    rank = RankSetup.create(recipe)
    # 3. vocab mapping from loss-masked token frequencies
    d2t, t2d, coverage = vocab_mapping(info, store, run_id, shape, work)
    # 4. data: shards staged ahead to bounded local disk; one loader per split
    data = TrainData.create(recipe, store, run_id, info, shape, work, rank.hs_dtype)
    # 5. model: speculators' Eagle3DraftModel with draft.architecture's layer and draft.norms
    model = build_draft_model(shape, recipe, tcfg, rank.attention, t2d, d2t)
    assert next(model.fc.parameters()).dtype == torch.float32  # fp32 master weights
    params = {"total": sum(p.numel() for p in model.parameters()),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    console.print(f"  draft parameters: {params['total']:,} total, {params['trainable']:,} trainable; "
                  f"attention {rank.attention}, loss {rank.loss}")
    # 6. resume from the newest committed checkpoint
    run = TrainRun(recipe, run_id, Stage(store, run_id, train_dir(variant)), work, max_steps, started)
    resumed = resume_checkpoint(recipe, run.stage, run.ckpt_dir)
    record = train_record(run, info, shape, rank, data, params, coverage)
    # 7. train, committing checkpoints; export the epoch with the best held-out tau estimate
    fit_and_export(run, model, data, rank, resumed, record)
    maybe_destroy_distributed()
    return record


def check_extraction(recipe: Recipe, store: Store, run_id: str) -> tuple[ExtractionInfo, PretrainedConfig, DraftShape]:
    """The committed extraction's info, the verifier's text config and the draft shape, checked against each other."""
    tcfg = text_config(load_config(recipe.verifier))
    if recipe.train.source == "stream":  # extraction is still going on: its layout is the recipe's
        from eagle_jobs.hsformat import resolve_storage

        layer_ids, hidden = stored_layer_ids(recipe.aux_layer_ids, int(tcfg.num_hidden_layers)), int(tcfg.hidden_size)
        rows = row_index(store, run_id)  # what extraction plans the stream from; read once, kept in info
        storage = resolve_storage(recipe.extract.storage_dtype, sum(r.num_tokens for r in rows), len(layer_ids),
                                  hidden, recipe.extract.fp8_above_bytes)
        info: ExtractionInfo = {"manifests": [], "storage": storage, "hidden_size": hidden, "layer_ids": layer_ids,
                                "rows": rows}
    else:
        info = extraction_info(store, run_id)
    shape = resolve_shape(recipe, tcfg)
    aux = info["layer_ids"][:-1]
    if aux != recipe.aux_layer_ids:
        raise BadInput(f"extraction of run '{run_id}' stored aux layers {aux}, the recipe's draft wants "
                       f"{recipe.aux_layer_ids}: rerun extract with this recipe or fix aux_layer_ids")
    if info["hidden_size"] != shape.hidden_size:
        raise BadInput(f"extraction hidden size {info['hidden_size']} != draft hidden size {shape.hidden_size}")
    console.print(f"[bold]train[/] draft shape: {shape.describe()}")
    return info, tcfg, shape


@dataclass(frozen=True)
class RankSetup:
    """What this process trains with, decided once: accelerator, attention, loss and hidden-state dtype."""

    gpu: bool
    attention: str
    loss: str
    hs_dtype: torch.dtype

    @classmethod
    def create(cls, recipe: Recipe) -> RankSetup:
        from eagle_jobs import speculators_compat as compat

        compat.install()
        compat.setup_distributed()
        gpu = compat.has_accelerator()
        a = recipe.train.attention
        attention = a if a != "auto" else ("simple_flex_attention" if gpu else "sdpa")
        if not gpu and attention == "simple_flex_attention":
            raise BadInput("train.attention simple_flex_attention needs a GPU (no flex backward on CPU): "
                           "use auto or sdpa")
        torch.manual_seed(recipe.train.seed)
        # bf16 states from the store; the draft keeps fp32 master weights. On GPU autocast runs
        # the matmuls in bf16; on CPU we upcast the states so dtypes always agree.
        return cls(gpu, attention, loss_implementation(recipe, gpu), torch.bfloat16 if gpu else torch.float32)


@dataclass(frozen=True)
class TrainRun:
    """One training of one draft: the recipe, where it commits (the train stage, or a compare arm's), its
    local work directory, the step cap and when it started."""

    recipe: Recipe
    run_id: str
    stage: Stage
    work: Path
    max_steps: int | None
    started: float

    @property
    def ckpt_dir(self) -> Path:
        """speculators' local save_path: one `<epoch>/` directory a checkpoint, committed to the stage."""
        return self.work / "checkpoints"


def train_record(run: TrainRun, info: ExtractionInfo, shape: DraftShape, rank: RankSetup, data: TrainData,
                 params: dict, coverage: float) -> TrainRecord:
    """train_config.json: what this draft was trained on and with (docs/FORMAT.md)."""
    from speculators.train.distributed import get_world_size

    recipe, run_id, max_steps = run.recipe, run.run_id, run.max_steps
    steps_per_epoch = len(data.train_loader)  # type: ignore[arg-type]
    return {
        "run_id": run_id, "verifier": recipe.verifier.model,
        "samples": {"train": len(data.items["train"]), "validation": len(data.items["validation"])},
        "epochs": recipe.train.epochs, "lr": recipe.train.lr, "scheduler": recipe.train.scheduler,
        "optimizer": recipe.train.optimizer, "world_size": get_world_size(), "steps_per_epoch": steps_per_epoch,
        "total_steps": max_steps or steps_per_epoch * recipe.train.epochs,
        "parameters": params, "draft_shape": shape.describe(),
        "aux_layer_ids": info["layer_ids"][:-1], "attention": rank.attention, "loss_implementation": rank.loss,
        "hidden_states_dtype": str(rank.hs_dtype).removeprefix("torch."), "recipe_digest": recipe.digest(),
        "vocab_coverage": coverage,
        # the images this run's pods ran, when submit pinned them by digest (lineage: promote copies it)
        "image_digests": settings().image_digests,
    }


def fit_and_export(run: TrainRun, model, data: TrainData, rank: RankSetup, resumed: CheckpointManifest | None,
                   record: TrainRecord) -> None:
    """speculators' Trainer, committing each checkpoint to the store; rank 0 exports the chosen epoch."""
    from speculators.train.distributed import get_rank, maybe_destroy_distributed
    from speculators.train.trainer import TrainerConfig

    from eagle_jobs import speculators_compat as compat

    recipe, stage, work, ckpt_dir = run.recipe, run.stage, run.work, run.ckpt_dir
    train_kwargs, val_kwargs = trainer_call_kwargs(recipe, rank.loss)  # ttt_steps, train.loss
    cfg = TrainerConfig(
        num_epochs=recipe.train.epochs, save_path=str(ckpt_dir), resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, hidden_states_dtype=rank.hs_dtype,
        **optimizer_settings(recipe),  # optimizer (Muon's group too), lr, weight decay, schedule, warmup
        log_freq=recipe.train.log_freq, fsdp_shard=recipe.train.fsdp, max_steps=run.max_steps,
    )
    recorder = compat.MetricsRecorder()
    resumed_metrics = ckpt_dir / str(resumed["epoch"] if resumed else None) / "metrics.json"
    if resumed_metrics.is_file():  # the epochs before a resume: their validation chooses the checkpoint too
        recorder.records = json.loads(resumed_metrics.read_text())
    metrics_log = logging.getLogger("speculators.metrics")
    metrics_log.addHandler(recorder)
    metrics_log.setLevel(logging.INFO)
    board = tensorboard_handler(work / "tensorboard") if get_rank() == 0 else None

    def on_checkpoint(epoch: int, local_step: int) -> None:
        (ckpt_dir / str(epoch) / "train_config.json").write_text(json.dumps(record, indent=1))
        (ckpt_dir / str(epoch) / "metrics.json").write_text(json.dumps(recorder.records))
        m = commit_checkpoint(stage, ckpt_dir, epoch, local_step, recipe.train_digest())
        prune_step_checkpoints(stage, m)
        prune_local_checkpoints(ckpt_dir, epoch)
        if data.feed is not None:
            data.feed.on_commit(epoch, local_step)
        if board is not None:
            upload_tensorboard(board, work / "tensorboard", stage)

    every = recipe.train.checkpoint_every_minutes
    trainer = compat.StoreTrainer(model, cfg, data.train_loader, data.val_loader, on_checkpoint=on_checkpoint,
                                  checkpoint_every_s=every and every * 60,
                                  checkpoint_due=data.feed.checkpoint_due if data.feed else None)
    try:
        trainer.run_training()  # its CPU warning filters live in compat (adaptation 4)
        if trainer.interrupted:
            maybe_destroy_distributed()
            raise EagleJobsError("train: interrupted by a signal; the checkpoint is committed, rerun to resume",
                                 ExitCode.INTERRUPTED)
        if data.feed is not None:
            record["stream"] = {"first_step_at": data.feed.first_step_at, "consumed_shards": len(data.feed.marked),
                                "window_bytes": data.feed.window, "later_epochs": recipe.train.later_epochs}
        if get_rank() == 0:
            export_selected(recipe, stage, ckpt_dir, record, recorder.records, run.started)
        if board is not None:
            upload_tensorboard(board, work / "tensorboard", stage)  # the validation of the last epoch too
    finally:  # off the process-wide logger whatever happened: a later run in this process gets its own
        metrics_log.removeHandler(recorder)
        if board is not None:
            metrics_log.removeHandler(board)
            board.close()


def tensorboard_handler(log_dir: Path) -> logging.Handler:
    """speculators' own TensorBoard handler on its metric logger: loss, accuracies, lr per step."""
    from speculators.train.logger import TensorBoardHandler

    handler = TensorBoardHandler(log_dir=str(log_dir), run_name="attempt-{utc_time}")  # one per pod attempt
    logging.getLogger("speculators.metrics").addHandler(handler)
    return handler


def upload_tensorboard(handler: logging.Handler, log_dir: Path, stage: Stage) -> None:
    """The event files to <run>/train/data/tensorboard/, beside the checkpoints, on every checkpoint:
    `aws s3 sync` that prefix and point TensorBoard at it. Logs, not a commit: later stages never read them."""
    handler.flush()
    for f in sorted(log_dir.rglob("*")):
        if f.is_file():
            stage.store.put(stage.key(f"data/tensorboard/{f.relative_to(log_dir).as_posix()}"), f.read_bytes())
