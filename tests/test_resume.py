"""Preemption costs minutes, not an epoch; the LR schedule resumes where it stopped.

Real training runs of the tiny verifier's draft, stopped as pods are stopped: a node loss kills every process
of the pod at once (SIGKILL, no grace), an eviction sends SIGTERM to the pod's main process (the kubelet,
then torchrun forwards it). A fresh pod (an empty work dir) then resumes from what the store holds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pipeline_helpers import _prepared
from proc_helpers import kill_pod, read_lines, wait_for

from eagle_jobs.errors import ExitCode
from eagle_jobs.store import Stage, Store
from eagle_jobs.train.checkpoints import checkpoint_order, committed_checkpoints
from eagle_jobs.train.run import run_train

TESTS = Path(__file__).resolve().parent


# -- pods -----------------------------------------------------------------------------
def spied_pod_main() -> None:
    """`eagle-jobs train` (argv) with a spy appending one JSON line to $STEP_LOG per finished training
    step (epoch, local step, global step, time, the dataset indices of its batch) and per checkpoint save
    (after its commit): what a SIGKILL leaves of it says exactly what the killed pod had done. A command
    that trains nothing (`extract`) runs as it is, without speculators' imports (about 8 CPU-s)."""
    from eagle_jobs import cli

    sys.argv = ["eagle-jobs", *sys.argv[1:]]
    if sys.argv[1] not in ("train", "run"):
        return cli.main()
    from speculators.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2 as Sampler,
    )

    from eagle_jobs import speculators_compat as compat

    log = open(os.environ["STEP_LOG"], "a", buffering=1)  # noqa: SIM115 - one line, one write
    fetched: dict = {}
    real_iter, real_epoch = Sampler.__iter__, compat.StoreTrainer.train_epoch
    real_save = compat.StoreTrainer.maybe_save_checkpoint

    def batches(self):  # num_workers 0: a batch is fetched when its step starts
        for b in real_iter(self):
            fetched["samples"] = [int(i) for i in b]
            yield b

    def train_epoch(self, epoch, *, step_callback=None):
        def done():
            log.write(json.dumps({"epoch": epoch, "step": self._cur_step, "global_step": self.global_step,
                                  "t": time.monotonic(), "samples": fetched["samples"]}) + "\n")

        return real_epoch(self, epoch, step_callback=done)

    def save(self, epoch, local_step=0):
        real_save(self, epoch, local_step)
        log.write(json.dumps({"saved": [epoch, local_step], "t": time.monotonic()}) + "\n")

    Sampler.__iter__, compat.StoreTrainer.train_epoch = batches, train_epoch
    compat.StoreTrainer.maybe_save_checkpoint = save
    cli.main()


def start_pod(recipe, st, tmp_path: Path, name: str, spied: bool = True) -> subprocess.Popen:
    """`eagle-jobs train` as a pod's main process, with its own empty work dir and log."""
    rfile = tmp_path / "recipe.json"
    rfile.write_text(json.dumps(recipe.model_dump(mode="json")))
    env = {**os.environ, "EAGLE_JOBS_WORK_DIR": str(tmp_path / f"work-{name}"), "EAGLE_JOBS_PROGRESS_INTERVAL_S": "0",
           "STEP_LOG": str(tmp_path / f"{name}.steps.jsonl"),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    entry = ["-c", "import test_resume; test_resume.spied_pod_main()"] if spied else ["-m", "eagle_jobs.cli"]
    out = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the pod's log, read while it runs
    return subprocess.Popen([sys.executable, *entry, "train", "--recipe", str(rfile), "--store", st.uri,
                             "--run-id", "r"], env=env, stdout=out, stderr=subprocess.STDOUT)


def read_json(stage: Stage, manifest: dict, name: str):
    """A JSON file of a committed shard, checked against its manifest's entry."""
    key = f"{manifest['shard']}/{name}"
    return json.loads(stage.read(key, manifest["files"][key]))


def read_final(stage: Stage, name: str):
    return read_json(stage, stage.manifest("final"), name)


# -- issue 20 item 7: a kill costs at most one interval ---------------------------------------------
def test_sigkill_mid_epoch_loses_at_most_one_interval_and_each_sample_is_trained_once_per_epoch(
        tiny_recipe, tmp_path, bucket):
    # an interval well inside an epoch: on a quiet machine an epoch of this tiny draft is 8 steps in about
    # 0.18 s (CI, 2026-12-04), so a 0.2 s clock fired at epoch ends only and the run finished before a
    # mid-epoch step checkpoint; 0.04 s fires every few steps, loaded or not
    every_s, epochs = 0.04, 12
    recipe = tiny_recipe(train={"epochs": epochs, "total_seq_len": 64, "checkpoint_every_minutes": every_s / 60})
    st = _prepared(recipe, f"s3://{bucket}/runs")
    stage = Stage(st, "r", "train")
    log1 = tmp_path / "pod1.steps.jsonl"
    pod1 = start_pod(recipe, st, tmp_path, "pod1")

    def mid_epoch_after_a_step_checkpoint() -> bool:  # the clock fired a few times; the newest save is a
        lines = read_lines(log1)                        # step checkpoint of epoch >= 1, then a step more
        saves = [i for i, e in enumerate(lines) if "saved" in e]
        if sum(1 for i in saves if lines[i]["saved"][1] > 0) < 3:
            return False
        (epoch, step), after = lines[saves[-1]]["saved"], lines[saves[-1] + 1:]
        return epoch >= 1 and step > 0 and any("step" in e and e["epoch"] == epoch for e in after)

    wait_for(pod1, tmp_path / "pod1.log", "a step after a step checkpoint", mid_epoch_after_a_step_checkpoint)
    kill_pod(pod1)
    lines1 = read_lines(log1)
    steps1 = [e for e in lines1 if "step" in e]
    step_saves = [e for e in lines1 if "saved" in e and e["saved"][1] > 0]
    assert len(step_saves) >= 3, lines1  # the clock fired a few times
    newest = max(committed_checkpoints(stage), key=checkpoint_order)
    assert newest["epoch"] >= 1 and newest["local_step"] > 0, newest  # a step checkpoint, mid-epoch
    assert newest["shard"] == f"checkpoint-{newest['epoch']:04d}-step-{newest['local_step']:07d}"
    at = (newest["epoch"], newest["local_step"])
    committed_step = next(e["global_step"] for e in steps1 if (e["epoch"], e["step"]) == at)
    saved_t = next(e["t"] for e in lines1 if "saved" in e and tuple(e["saved"]) == at)
    lost = steps1[-1]["global_step"] - committed_step
    # one interval of steps: those that ended within every_s of the commit, plus the step that found the
    # interval over (its save may be what the kill cut short)
    one_interval = sum(1 for e in steps1 if saved_t < e["t"] <= saved_t + every_s) + 1
    assert 0 <= lost <= one_interval, (lost, one_interval, lines1[-8:])
    # superseded step checkpoints are gone from the store, manifest and objects: only the newest is left
    step_shards = [m["shard"] for m in committed_checkpoints(stage) if m["local_step"]]
    assert step_shards == [newest["shard"]]
    assert {k.rsplit("/", 1)[1] for k in st.list(stage.key("data")) if "-step-" in k} == {newest["shard"]}

    pod2 = start_pod(recipe, st, tmp_path, "pod2")  # a fresh pod: empty work dir
    assert pod2.wait(timeout=600) == 0, (tmp_path / "pod2.log").read_text()[-3000:]
    # s3fs answers reads from its listing cache: what pod 2 wrote is read through a store opened after it
    stage = Stage(Store.open(st.uri), "r", "train")
    steps2 = [e for e in read_lines(tmp_path / "pod2.steps.jsonl") if "step" in e]
    assert (steps2[0]["epoch"], steps2[0]["step"], steps2[0]["global_step"]) == (*at[:1], at[1] + 1, committed_step + 1)
    # each training sample once per epoch: pod 1's committed steps, then pod 2's
    n_train = read_final(stage, "train_config.json")["samples"]["train"]
    for epoch in range(epochs):
        seen = [s for e in steps1 if e["epoch"] == epoch and (e["epoch"], e["step"]) <= at for s in e["samples"]]
        seen += [s for e in steps2 if e["epoch"] == epoch for s in e["samples"]]
        assert sorted(seen) == list(range(n_train)), (epoch, sorted(seen))
    # the run's record has every step once; the epoch checkpoints superseded every step checkpoint
    assert [r["global_step"] for r in read_final(stage, "metrics.json") if "train" in r] == list(
        range(steps2[-1]["global_step"]))
    assert [m["shard"] for m in stage.manifests()] == [*(f"checkpoint-{e:04d}" for e in range(epochs)), "final"]


# -- issue 21 item 6: the LR schedule resumes where it stopped, on two ranks --------------------------
def lr_per_step(metrics: list[dict]) -> list[tuple[int, float]]:
    return [(r["global_step"], r["lr"]) for r in metrics if "train" in r]


def test_two_ranks_resume_the_lr_schedule_where_it_stopped(tiny_recipe, tmp_path):
    """An uninterrupted two-rank run, then the same training killed after its first epoch checkpoint,
    resumed, evicted mid-epoch (SIGTERM), resumed again: the same learning rate at every step.

    The eviction, as the kubelet sends it, to the pod's main process only: both ranks stop after the same
    step, rank 0 commits that checkpoint, the pod exits 143, and the next pod keeps the first pods' records."""
    recipe = tiny_recipe(train={"nproc_per_node": 2, "total_seq_len": 64, "epochs": 3, "warmup_ratio": 0.2})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    expected = lr_per_step(run_train(recipe, st, "r", work_dir=tmp_path / "w-whole")["metrics"])
    assert len({lr for _, lr in expected}) > len(expected) // 2  # warmup then cosine: the lr moves every step
    shutil.rmtree(tmp_path / "s/r/train")  # the same extraction, trained again with interruptions
    stage = Stage(st, "r", "train")

    pod1 = start_pod(recipe, st, tmp_path, "pod1", spied=False)
    wait_for(pod1, tmp_path / "pod1.log", "checkpoint-0000", lambda: stage.manifest("checkpoint-0000") is not None)
    kill_pod(pod1)
    after_kill = max(committed_checkpoints(stage), key=checkpoint_order)
    assert after_kill["local_step"] == 0  # an epoch checkpoint

    pod2 = start_pod(recipe, st, tmp_path, "pod2", spied=False)
    log2 = tmp_path / "pod2.log"
    wait_for(pod2, log2, "two steps of a resumed epoch",
             lambda: any(f"train epoch {e}: 2/" in log2.read_text() for e in (1, 2)))
    pod2.send_signal(signal.SIGTERM)  # to the main process only, as the kubelet sends it
    assert pod2.wait(timeout=300) == ExitCode.INTERRUPTED, log2.read_text()[-3000:]
    assert f"resuming from committed {after_kill['shard']} (epoch {after_kill['epoch']}, step end)" in log2.read_text()
    exits = {p.name: p.read_text() for p in (tmp_path / "work-pod2/r/rank-exits").iterdir()}
    assert exits == {"0": "143", "1": "143"}  # both ranks stopped and saved, neither was killed in a collective
    newest = max(committed_checkpoints(stage), key=checkpoint_order)
    # the SIGTERM save: mid-epoch. Not necessarily at the step the log showed: the signal goes through the
    # pod's main process and torchrun to the ranks, and on a fast CPU (tiny steps) they had finished epoch 1,
    # committed it and run a step of epoch 2 by then (local_step 1, 2026-12-06)
    assert newest["local_step"] >= 1 and not stage.is_complete(), newest
    before = read_json(stage, newest, "metrics.json")

    rec = run_train(recipe, st, "r", work_dir=tmp_path / "w3")
    assert lr_per_step(rec["metrics"]) == expected
    assert rec["metrics"][: len(before)] == before  # the earlier pods' records are kept (checkpoint selection)
    steps = [m["global_step"] for m in rec["metrics"][len(before):] if "train" in m]
    assert stage.is_complete() and min(steps) >= newest["epoch"] * rec["steps_per_epoch"] + newest["local_step"]


# -- adaptation 11, at the unit: speculators' own resume path and ours ----------------------------------
@pytest.mark.parametrize("saved_with_scheduler", [False, True], ids=["no-initial_lr", "no-scheduler-state"])
def test_adaptation_11_scheduler_resumes_at_the_global_step(tiny_recipe, tmp_path, saved_with_scheduler):
    """speculators 0.9.0 resumes its scheduler at `last_epoch=previous_epoch` (#1048, #900): an optimizer
    state without `initial_lr` raises KeyError there, and without a scheduler state the schedule sits at the
    epoch index. Ours lands where an uninterrupted run's is after the restored global step, either way."""
    from conftest import draft_and_batch
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.trainer import Trainer, TrainerConfig
    from transformers import get_cosine_schedule_with_warmup

    from eagle_jobs import speculators_compat as compat

    compat.install()
    steps_per_epoch, global_step, lr = 10, 37, 1e-3
    (model,), _, _ = draft_and_batch(tiny_recipe(), "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if saved_with_scheduler:  # initial_lr in the optimizer's groups, the scheduler's own state not kept
        get_cosine_schedule_with_warmup(opt, 5, 4 * steps_per_epoch)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3) if p.requires_grad else None
    opt.step()  # moments to restore
    SingleGPUCheckpointer(tmp_path).save_checkpoint(model, opt, epoch=3)
    (tmp_path / "3/training_state.json").write_text(json.dumps({"epoch": 3, "local_step": 7,
                                                                "global_step": global_step}))
    cfg = TrainerConfig(lr=lr, num_epochs=4, save_path=str(tmp_path), resume_from_checkpoint=True,
                        scheduler_type="cosine", scheduler_warmup_steps=5)
    loader = [None] * steps_per_epoch  # setup reads only its length
    fresh = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=lr), 5, 4 * steps_per_epoch)
    for _ in range(global_step):
        fresh.optimizer.step()
        fresh.step()
    want = fresh.get_last_lr()
    if saved_with_scheduler:
        upstream = Trainer(model, cfg, loader)
        assert upstream.schedulers[0].last_epoch == 4  # the epoch index + its initial step, not step 37
        assert upstream.optimizers[0].param_groups[0]["lr"] != pytest.approx(want[0])
    else:
        with pytest.raises(KeyError, match="initial_lr"):
            Trainer(model, cfg, loader)
    ours = compat.StoreTrainer(model, cfg, loader)
    assert ours.global_step == global_step and ours.schedulers[0].last_epoch == global_step
    assert ours.schedulers[0].get_last_lr() == want
    assert [g["lr"] for g in ours.optimizers[0].param_groups] == want
    assert len(ours.optimizers[0].state) > 0  # the optimizer's moments were restored too


def test_adaptation_11_resumes_both_of_muons_schedules(tiny_recipe, tmp_path):
    """optimizer muon (the demo recipes' default) is two optimizers, Muon on 2-D weights and AdamW on the
    rest, each with its own schedule (speculators/train/trainer.py setup_optimizer): a resume puts both at
    the restored global step with their own base rates, and restores both optimizers' state."""
    from conftest import draft_and_batch
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from transformers import get_cosine_schedule_with_warmup

    from eagle_jobs import speculators_compat as compat

    compat.install()
    steps_per_epoch, global_step, lr, muon_lr = 10, 23, 1e-3, 2e-2
    (model,), _, _ = draft_and_batch(tiny_recipe(), "sdpa")
    cfg = TrainerConfig(lr=lr, num_epochs=4, save_path=str(tmp_path), resume_from_checkpoint=True,
                        scheduler_type="cosine", scheduler_warmup_steps=5, optimizer="muon", muon_lr=muon_lr)
    opts = build_optimizers(model, cfg)
    assert len(opts) == 2
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3) if p.requires_grad else None
    for o in opts:
        o.step()  # moments to restore
    SingleGPUCheckpointer(tmp_path).save_checkpoint(model, opts, epoch=2)
    (tmp_path / "2/training_state.json").write_text(json.dumps({"epoch": 2, "local_step": 3,
                                                                "global_step": global_step}))
    ours = compat.StoreTrainer(model, cfg, [None] * steps_per_epoch)
    assert len(ours.schedulers) == 2 and ours.global_step == global_step
    for sched, opt in zip(ours.schedulers, ours.optimizers, strict=True):
        base = sched.base_lrs[0]
        fresh = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=base), 5, 4 * steps_per_epoch)
        for _ in range(global_step):
            fresh.optimizer.step()
            fresh.step()
        assert sched.last_epoch == global_step
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(fresh.get_last_lr() * len(opt.param_groups))
        assert len(opt.state) > 0
    assert sorted(s.base_lrs[0] for s in ours.schedulers) != [lr, lr]  # Muon's group kept its own rate
