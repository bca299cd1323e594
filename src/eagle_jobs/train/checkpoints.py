"""Checkpoints in the store and the epoch final/ exports: a checkpoint committed every epoch, every
train.checkpoint_every_minutes and on SIGTERM (speculators' local `<epoch>/` directory as one shard),
the newest restored to resume at its exact step, superseded ones pruned, and the epoch with the best
held-out tau estimate exported as final/ (what vLLM serves).

Functions, not a class over the store `Stage`: half of them never touch one (names, their order, the
epoch choice, local directories), the rest take the stage their caller (train's run, epochs) already
holds, and a class would only wrap that one argument.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import cast

from eagle_jobs.committed import tau_estimate
from eagle_jobs.errors import BadInput
from eagle_jobs.progress import console
from eagle_jobs.recipe import Recipe
from eagle_jobs.records import CheckpointFields, CheckpointManifest, Selection, TrainRecord
from eagle_jobs.store import Stage


def committed_checkpoints(stage: Stage) -> list[CheckpointManifest]:
    return [m for m in cast(list[CheckpointManifest], stage.manifests()) if m["shard"].startswith("checkpoint-")]


def checkpoint_name(epoch: int, local_step: int) -> str:
    """checkpoint-<epoch> at an epoch's end (local_step 0, speculators' convention), and
    checkpoint-<epoch>-step-<step> mid-epoch: a name is committed once, never rewritten."""
    return f"checkpoint-{epoch:04d}" + (f"-step-{local_step:07d}" if local_step else "")


def checkpoint_order(m: CheckpointManifest) -> tuple[int, float]:
    """Older first: an epoch's end comes after every step of that epoch."""
    return (m["epoch"], m.get("local_step") or math.inf)


def restore_latest(stage: Stage, local: Path, recipe_digest: str) -> CheckpointManifest | None:
    """Put the newest committed checkpoint, epoch or step, where speculators' Trainer resumes from;
    its manifest, or None."""
    ckpts = committed_checkpoints(stage)
    if not ckpts:
        return None
    m = max(ckpts, key=checkpoint_order)
    if m.get("recipe_digest") != recipe_digest:
        raise BadInput(f"run '{stage.run_id}' has checkpoints from another recipe (digest {m.get('recipe_digest')}, "
                       f"this one {recipe_digest}): use a new --run-id, or delete {stage.store.url(stage.prefix)}")
    restore_checkpoint(stage, local, m)
    return m


def epoch_checkpoints(stage: Stage) -> dict[int, CheckpointManifest]:
    """The committed end-of-epoch checkpoints (the export's candidates): epoch -> manifest."""
    return {m["epoch"]: m for m in committed_checkpoints(stage) if not m.get("local_step")}


def restore_epoch(stage: Stage, local: Path, epoch: int) -> None:
    """The end-of-epoch checkpoint of `epoch` back on local disk (the export's source)."""
    restore_checkpoint(stage, local, epoch_checkpoints(stage)[epoch])


# What final/ keeps of a checkpoint: the weights and config vLLM serves, and speculators' validation.
SERVED_FILES = ("model.safetensors", "config.json", "val_metrics.json")


def restore_served(stage: Stage, m: CheckpointManifest, dest: Path) -> Path:
    """Only what vLLM serves of the checkpoint `m`, in dest: a draft directory, without the optimizer
    state (the draft's twice over) that a resume needs and a server does not."""
    dest.mkdir(parents=True, exist_ok=True)
    for f, info in m["files"].items():
        name = f.split("/", 1)[1]
        if name in SERVED_FILES:
            (dest / name).write_bytes(stage.read(f, info))
    return dest


def restore_checkpoint(stage: Stage, local: Path, m: CheckpointManifest) -> None:
    from eagle_jobs.speculators_compat import import_checkpoint_dir

    objects = {f.split("/", 1)[1]: stage.read(f, info) for f, info in m["files"].items()}
    import_checkpoint_dir(objects, local / str(m["epoch"]))


def select_epoch(records: list[dict], k: int, last: int) -> Selection:
    """The epoch whose checkpoint becomes final/: the best held-out τ estimate, not the lowest loss.

    EAGLE-3 drafts peak after a few epochs and then lose τ while their loss keeps falling. Per epoch,
    speculators' validation gives full_acc_i: the share of held-out positions whose first i+1 draft
    tokens are all right, teacher forced; 1 + Σ_{i<k} full_acc_i estimates τ at k.
    """
    est: dict[int, float] = {}
    for r in records:
        if "val" in r and "epoch" in r and (tau := tau_estimate(r["val"], k)) is not None:
            est[int(r["epoch"])] = tau
    if not est:
        return {"epoch": last, "by": "the last epoch: no held-out samples to measure on", "per_epoch": {}}
    best = max(sorted(est), key=lambda e: est[e])  # the earliest among equals
    return {"epoch": best, "by": f"the best held-out teacher-forced tau estimate, 1 + sum of full_acc_i for i < {k} "
            "(not the lowest loss)", "tau_estimate": est[best], "last_epoch": last,
            "per_epoch": {str(e): est[e] for e in sorted(est)}}


def estimate_depth(recipe: Recipe) -> int:
    """The k of the tau estimate: the draft tokens evaluate serves, as far as training validated them."""
    return min(recipe.evaluate.k, recipe.train.ttt_steps)


def commit_checkpoint(stage: Stage, local: Path, epoch: int, local_step: int, recipe_digest: str) -> CheckpointManifest:
    """speculators' local `<epoch>/` directory as one shard of the store; its manifest."""
    from eagle_jobs.speculators_compat import export_checkpoint_dir

    name = checkpoint_name(epoch, local_step)
    objects = {f"{name}/{k}": v for k, v in export_checkpoint_dir(local / str(epoch)).items()}
    fields: CheckpointFields = {"epoch": epoch, "local_step": local_step, "recipe_digest": recipe_digest}
    m = cast(CheckpointManifest, stage.commit_shard(name, objects, fields))
    console.print(f"  committed {name} (step {local_step or 'end'}) to {stage.store.url(stage.prefix)}")
    return m


def prune_step_checkpoints(stage: Stage, newest: CheckpointManifest) -> None:
    """Step checkpoints older than `newest` (just committed, step or epoch) are superseded: each is
    uncommitted (its manifest first, so no reader finds a manifest without its objects), then its
    objects go. Epoch checkpoints stay: the export chooses among them."""
    for m in committed_checkpoints(stage):
        if m["local_step"] and checkpoint_order(m) < checkpoint_order(newest):
            stage.store.delete(stage.key(f"manifests/{m['shard']}.json"))
            stage.store.delete(stage.key(f"data/{m['shard']}"))


def prune_local_checkpoints(ckpt_dir: Path, committed: int) -> None:
    """Once epoch `committed` is in the store, older local epochs are only disk: a Kimi-K2.5 draft's is
    about 8 GiB, and ten of them would fill the pod's /work. The newest stays, for the final export."""
    for p in ckpt_dir.iterdir():
        if p.name.isdigit() and not p.is_symlink() and int(p.name) < committed:
            shutil.rmtree(p)


def resume_checkpoint(recipe: Recipe, stage: Stage, ckpt_dir: Path) -> CheckpointManifest | None:
    """Every node restores the newest committed checkpoint of this recipe into ckpt_dir; its manifest, or None."""
    from speculators.train.distributed import get_local_rank, is_distributed

    resumed = None
    if get_local_rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        resumed = restore_latest(stage, ckpt_dir, recipe.train_digest())
        if resumed is not None:
            console.print(f"  resuming from committed {resumed['shard']} (epoch {resumed['epoch']}, "
                          f"step {resumed['local_step'] or 'end'})")
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()  # no rank looks for a checkpoint before it is on disk
    return resumed


def export_selected(recipe: Recipe, stage: Stage, ckpt_dir: Path, record: TrainRecord, records: list[dict],
                    started: float) -> None:
    """Export the epoch with the best held-out tau estimate, as vLLM serves it."""
    last = max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and not p.is_symlink())
    record["selection"] = sel = select_epoch(records, estimate_depth(recipe), last)
    record["metrics"] = records
    if not (ckpt_dir / str(sel["epoch"])).is_dir():  # pruned locally once committed: fetch it back
        restore_epoch(stage, ckpt_dir, sel["epoch"])
    if sel["epoch"] != last:
        console.print(f"  exporting epoch {sel['epoch']} (tau estimate {sel['tau_estimate']:.3f}), "
                      f"not the last ({sel['per_epoch'].get(str(last), float('nan')):.3f})")
    record["train_seconds"] = round(time.time() - started, 1)  # this process's, from the shape check
    export_final(stage, ckpt_dir / str(sel["epoch"]), record, recipe)


def export_final(stage: Stage, ckpt: Path, record: TrainRecord, recipe: Recipe, meta: dict | None = None) -> None:
    """ckpt (a local epoch directory) as final/: objects first, the manifest last, then COMPLETE.
    meta: more manifest fields (the served selection marks itself there)."""
    from eagle_jobs.speculators_compat import export_checkpoint_dir

    objects = {k: v for k, v in export_checkpoint_dir(ckpt).items() if k in SERVED_FILES}
    objects["train_config.json"] = json.dumps({k: v for k, v in record.items() if k != "metrics"}, indent=1).encode()
    objects["metrics.json"] = json.dumps(record["metrics"]).encode()
    objects["recipe.json"] = json.dumps(recipe.model_dump(mode="json"), indent=1).encode()  # lineage
    stage.commit_shard("final", {f"final/{k}": v for k, v in objects.items()},
                       {"epoch": int(ckpt.name), **(meta or {})})
    stage.complete({"final": stage.store.url(stage.key("data/final"))})
    console.print(f"  final draft: {stage.store.url(stage.key('data/final'))}")
