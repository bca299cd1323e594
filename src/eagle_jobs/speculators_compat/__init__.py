"""Every adaptation of speculators 0.9.0 that eagle-jobs makes, in one place.

speculators' Trainer assumes an accelerator. On a CPU-only machine we change
exactly points 1-4, 7 and 14; on every machine, 12 (each adaptation has a test in
tests/test_speculators_compat.py):

1. `Trainer.setup_model` moves the model to `get_local_rank()` (an int):
   on CPU the device is "cpu".
2. `_StepTimer.mark` / `.now` call `torch.accelerator.synchronize()`: skipped
   when there is no accelerator.
3. `SingleGPUCheckpointer.load_*` map tensors to `get_current_device()`, which
   answers "cuda:0" without an accelerator: "cpu" there.
4. `Trainer.device_type` falls back to "cuda" for autocast: on CPU we feed fp32
   hidden states (upcast from the stored bf16) into the fp32-master draft and
   disable autocast, so no dtype mismatch can reach `fc`.
7. `maybe_setup_distributed` raises "No accelerator found" under torchrun on a
   CPU: there `setup_distributed` starts the gloo backend and fills the same
   topology state, so the DDP/FSDP code paths (rank-0 saves, barriers, the
   distributed sampler) run, and are tested, on CPU (see below).

Behaviours we add through a subclass, not a patch (5, 6, 8-11):
5. after each checkpoint the directory is committed to the store (rank 0),
   optimizer and scheduler state converted from torch pickles to
   safetensors + JSON so nothing read back from a bucket is ever unpickled;
6. SIGTERM (pod eviction) saves a mid-epoch checkpoint as `<epoch>/` with its
   step, which speculators' own resume logic picks up. speculators raises at the
   signal, wherever each rank happens to be; with several ranks one can sit in
   an all-reduce while another enters the save's barrier. So the signal only sets
   a flag, and at the end of each optimizer step the ranks agree (an all-reduce
   of the flag) to stop together, at the same step; speculators' own handler
   then saves. A second signal more than FORCE_AFTER_S later stops at once.
8. speculators' tqdm.rich bar prints nothing until it stops when stderr is not a
   terminal (a pod's log): rank 0 then prints plain lines, steps done and ETA,
   every EAGLE_JOBS_PROGRESS_INTERVAL_S (tested in tests/test_train.py,
   test_loss_decreases_on_its_training_data).
9. speculators' loss specs are names (or a JSON dict of weights) only: lk_hybrid's
   `eta` keeps its default 3.0 whatever the caller wants. `with_loss_parameters`
   binds train.loss.eta to speculators' own lk_hybrid function (fused or eager)
   in the loss config its get_trainer_kwargs resolved; every other term is left
   as speculators resolved it.
10. step checkpoints on a clock: speculators saves mid-epoch only at fixed
   fractions of an epoch (`checkpoint_freq` < 1), and an epoch of a Kimi-size
   run is hours. With `checkpoint_every_s`, when that much time has passed on
   rank 0 since its last commit, the ranks learn it (an all-reduce, as for the
   stop flag of 6) and save after the same step, through speculators' own mid-epoch save
   (`<epoch>/` with `training_state.json`'s local step), which its resume picks
   up: the sampler's batch list for an epoch is a function of seed + epoch, and
   `_prepare_resume_skip` slices off the steps already done (tests/test_resume.py).
11. `Trainer.setup_optimizer` resumes its LR scheduler with
   `last_epoch=previous_epoch`: an epoch index for a scheduler that steps once per
   optimizer step, and a `KeyError: 'initial_lr'` when the restored optimizer
   state has no `initial_lr` (speculators #1048, #900; torch's LRScheduler
   requires it for last_epoch >= 0). We build optimizers and schedulers fresh
   (last_epoch -1: initial_lr is the configured lr), then load the optimizer state
   and put every scheduler at the restored global step, the unit it counts in.
And one patch of module state, for GPUs:
12. `speculators.losses.fused` decorates its forward and backward loss kernels with
   one `triton.autotune` object, so both kernels' `.configs` are the same list.
   On a GPU the draft's forward (the loss included) runs under torch.compile,
   and torch 2.11's dynamo stops there: "ListVariable(length=21) is already
   tracked for mutation" when the backward kernel's launch meets the list it
   tracked from the forward's (benchmarks/gpu_check.py on an H200 shows it).
   Each autotuned kernel gets its own copy of the list; the values
   are unchanged.
And for train.source stream:
13. `_setup_dataloader` builds its own MultipackDistributedBatchSamplerV2 over the
   dataset's lengths, shuffled across the whole epoch. `stream_dataloader` builds the
   same DataLoader (CollateFn, workers by spawn, pinned memory) around the stream's
   sampler (train.data.StreamBatchSampler, a subclass of speculators' own), and
   StoreTrainer also saves after a step where `checkpoint_due(epoch, step)` is true
   (the same on every rank: it is computed from the plan), so training commits the
   checkpoint that lets the shards it has finished with leave the window.
And one for CPUs, where the recipes' Muon would be most of a step's time:
14. torch.optim.Muon (speculators' Muon group) orthogonalises each update by Newton-Schulz
   iterations in bf16 (torch/optim/_muon.py, `_zeropower_via_newtonschulz`). A CPU without
   AVX512-BF16/AMX runs bf16 matmuls some 15x slower than fp32 (4.4 s against 0.3 s for four
   iterations at the demo draft's 576 x 1536 on an AVX2 CPU): over the demo draft's weight
   shapes an optimizer step took 28 s in bf16 and 1.9 s in fp32 (docs/DEMO.md). On CPU the same
   iterations run in fp32 and the update is rounded to bf16, as torch returns it; on an accelerator
   torch's own function runs. `newton_schulz_fp32` is torch 2.13's function with the dtype changed (torch
   takes no dtype), so a test holds it equal to torch's own at bf16 precision, to catch a drift.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import signal
import time
import warnings

import torch
from speculators.train import checkpointer as _ckpt
from speculators.train import trainer as _trainer
from speculators.train.graceful_shutdown import TrainingInterruptedError, with_graceful_shutdown
from torch.optim import _muon

from eagle_jobs.progress import PlainTicker, console

# 5: what a checkpoint directory becomes on the store, and back (re-exported: the adaptations' one name)
from eagle_jobs.speculators_compat.checkpoint_state import (  # noqa: F401
    export_checkpoint_dir,
    import_checkpoint_dir,
    state_from_safe,
    state_to_safe,
)

PINNED = "0.9.0"
INSTALLED = importlib.metadata.version("speculators")
if INSTALLED.split("+")[0] != PINNED:  # pragma: no cover - guarded by the pin
    raise ImportError(f"eagle_jobs.speculators_compat is written for speculators {PINNED}, found {INSTALLED}")


def has_accelerator() -> bool:
    return torch.accelerator.current_accelerator(check_available=True) is not None


_installed = False
TORCH_NEWTON_SCHULZ = _muon._zeropower_via_newtonschulz  # torch's own, which 14 replaces on CPU


def unshare_autotune_configs() -> None:
    """12: each of speculators' autotuned loss kernels holds its own list of configs (idempotent)."""
    try:
        import triton
        from speculators.losses import fused
    except ImportError:  # no triton: the fused loss cannot run here, so nothing to compile
        return
    for kernel in vars(fused).values():
        if isinstance(kernel, triton.runtime.Autotuner):
            kernel.configs = list(kernel.configs)


def install() -> None:
    """Apply adaptation 12, and 1-3 on machines without an accelerator (idempotent)."""
    global _installed
    if _installed:
        return
    unshare_autotune_configs()
    if has_accelerator():
        _installed = True
        return
    # 1. The Trainer passes get_local_rank() to .to() as a device; speculators annotates it as int, but "cpu"
    # is the device meant here: a deliberate replacement, not a type error
    _trainer.get_local_rank = lambda: "cpu"  # type: ignore[assignment,return-value]

    def mark(self, name: str) -> None:  # 2
        if self.enabled:
            self._marks[name] = time.perf_counter()  # noqa: SLF001

    def now(self):
        return time.perf_counter() if self.enabled else None

    # replacing these methods is this module's purpose (mypy flags any assignment to a method as a likely mistake)
    _trainer._StepTimer.mark, _trainer._StepTimer.now = mark, now  # type: ignore[method-assign]  # noqa: SLF001
    _ckpt.get_current_device = lambda: "cpu"  # 3
    _muon._zeropower_via_newtonschulz = newton_schulz_fp32  # 14: Muon looks it up in its module at each step
    _installed = True


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """14: torch's `_zeropower_via_newtonschulz` (torch 2.13) with its matmuls in fp32, returned in bf16 as there."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x.bfloat16()


def setup_distributed() -> None:
    """speculators' `maybe_setup_distributed`, with gloo when there is no accelerator (7)."""
    from speculators.train import distributed as _dist

    if has_accelerator() or "LOCAL_RANK" not in os.environ:
        _dist.maybe_setup_distributed()
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")
    # the same module state maybe_setup_distributed fills, read by speculators' getters
    _dist._local_rank, _dist._is_distributed = int(os.environ["LOCAL_RANK"]), True  # noqa: SLF001
    _dist._rank, _dist._world_size = dist.get_rank(), dist.get_world_size()  # noqa: SLF001
    _dist._init_sp_process_groups(_dist._rank, _dist._world_size, 1)  # noqa: SLF001


def with_loss_parameters(loss_config: dict, eta: float | None = None) -> dict:
    """speculators' resolved loss config with lk_hybrid's eta bound (9); unchanged when eta is None."""
    import functools

    if eta is None:
        return loss_config
    return {name: (functools.partial(fn, eta=eta) if name == "lk_hybrid" else fn, weight)
            for name, (fn, weight) in loss_config.items()}


class MetricsRecorder(logging.Handler):
    """Collects speculators' per-step metric records ({"train": ..., "global_step": ...})."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.records.append(json.loads(json.dumps(record.msg, default=float)))


FORCE_AFTER_S = 10.0  # repeats sooner are torchrun re-sending the same request


class StoreTrainer(_trainer.Trainer):
    """speculators' Trainer + commit-to-store after each checkpoint + SIGTERM mid-epoch save."""

    _checkpoint_every_s: float | None = None  # 10: None, epoch checkpoints only
    _saved_at, _saved_step = 0.0, (-1, -1)  # 10: when, and after which (epoch, step), the last save was

    def __init__(self, *args, on_checkpoint=None, checkpoint_every_s: float | None = None,
                 checkpoint_due=None, **kwargs):
        self._on_checkpoint = on_checkpoint
        self._checkpoint_due = checkpoint_due  # 13
        self._cur_epoch, self._cur_step = 0, 0
        self.interrupted = False
        self._signalled_at: float | None = None
        self._checkpoint_every_s = checkpoint_every_s
        super().__init__(*args, **kwargs)
        if not has_accelerator():
            self.device_type = "cpu"  # 4: autocast(cpu, fp32) is disabled by torch, silently below

    def train_epoch(self, epoch: int, *, step_callback=None):
        self._cur_epoch = epoch
        self._cur_step = getattr(self, "_resume_local_step", 0) if epoch == self.current_epoch else 0
        sampler = getattr(self.train_loader, "batch_sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # the count below is this epoch's, not the previous one's
        num_steps = len(self.train_loader)
        # 8: speculators' tqdm.rich bar prints nothing off a terminal (a pod's log): plain lines there
        ticker = None
        if self.rank == 0 and not console.is_terminal:
            ticker = PlainTicker(f"train epoch {epoch}", num_steps, "steps")
            ticker.done = self._cur_step

        def counted():
            self._cur_step += 1
            if ticker is not None:
                ticker.tick()
            if step_callback:
                step_callback()
            if self._stop_agreed():  # 6
                raise TrainingInterruptedError(f"signal, stopping after step {self._cur_step}")
            due = self._checkpoint_due is not None and self._checkpoint_due(epoch, self._cur_step)  # 13
            if (self._step_checkpoint_agreed() or due) and self._cur_step < num_steps:  # 10 (the epoch's own follows)
                self.maybe_save_checkpoint(epoch, local_step=self._cur_step)

        return super().train_epoch(epoch, step_callback=counted)

    @with_graceful_shutdown()
    def run_training(self):
        """speculators' loop under our handler: a signal is a request, honoured at a step boundary (6)."""

        def request(signum, _frame):
            now = time.monotonic()
            if self._signalled_at is not None and now - self._signalled_at > FORCE_AFTER_S:
                raise TrainingInterruptedError(signal.Signals(signum).name)  # forced: stop where we are
            if self._signalled_at is None:
                self._signalled_at = now
                logging.getLogger("speculators").warning(
                    f"{signal.Signals(signum).name}: stopping at the end of this step to save a checkpoint")

        outer = {s: signal.signal(s, request) for s in (signal.SIGTERM, signal.SIGINT)}
        self._saved_at = time.monotonic()  # 10: the interval counts training, not model loading
        try:
            with warnings.catch_warnings():
                if not has_accelerator():  # 4: the fp32 autocast request is meant to be a no-op, and
                    warnings.filterwarnings("ignore", message=".*[Aa]utocast.*")
                    # speculators' loaders pin memory; torch says why not, every epoch
                    warnings.filterwarnings("ignore", message=".*pin_memory.*")
                return _trainer.Trainer.run_training.__wrapped__(self)  # the loop itself, without its own handler
        finally:
            for s, h in outer.items():
                signal.signal(s, h)

    def _stop_agreed(self) -> bool:
        return self._any_rank(self._signalled_at is not None)

    def _step_checkpoint_agreed(self) -> bool:
        every = self._checkpoint_every_s
        if every is None:  # the same recipe on every rank: no collective to agree on nothing
            return False
        # rank 0's clock, restarted when its commit is done: the interval is training time between commits
        return self._any_rank(self.rank == 0 and time.monotonic() - self._saved_at >= every)

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when true on any: the ranks stop (6) and save (10) after the same step,
        or none does (speculators' saves are collectives)."""
        if not self.is_distributed:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=self.local_rank)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def maybe_save_checkpoint(self, epoch, local_step: int = 0):
        if epoch == "interrupted":  # 6
            self.interrupted = True
            if self._cur_step == 0 or self._saved_step == (self._cur_epoch, self._cur_step):
                return  # nothing new since the last committed checkpoint
            epoch, local_step = self._cur_epoch, self._cur_step
        super().maybe_save_checkpoint(epoch, local_step=local_step)
        if self._on_checkpoint is not None and self.rank == 0 and isinstance(epoch, int):
            self._on_checkpoint(epoch, local_step)  # 5
        self._saved_at, self._saved_step = time.monotonic(), (epoch, local_step)  # 10

    def setup_optimizer(self):
        """speculators' optimizers and schedulers built fresh, then resumed at the global step (11)."""
        resuming = self.resume_from_checkpoint and self.checkpointer.previous_epoch != -1
        self.resume_from_checkpoint = False  # its resume path: last_epoch = an epoch index, KeyError
        try:
            super().setup_optimizer()
        finally:
            self.resume_from_checkpoint = self.config.resume_from_checkpoint
        if resuming:
            self.checkpointer.load_optimizer_state_dict(self.model, self.optimizers)
            resume_schedulers(self.schedulers, self.global_step)


def resume_schedulers(schedulers: list, global_step: int) -> None:
    """Put each of speculators' schedulers (transformers' warmup schedules: LambdaLR, stepped once per
    optimizer step) where an uninterrupted run's is after `global_step` steps, and its optimizer's
    learning rate with it (11). base_lrs are the configured rates, from the fresh construction."""
    for sched in schedulers:
        if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
            raise TypeError(f"cannot resume a {type(sched).__name__}: speculators 0.9.0 builds LambdaLR schedules")
        lrs = [base * fn(global_step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        sched.last_epoch, sched._last_lr = global_step, lrs  # noqa: SLF001 - what step() would have left
        for group, base, lr in zip(sched.optimizer.param_groups, sched.base_lrs, lrs, strict=True):
            group["initial_lr"], group["lr"] = base, lr


def stream_dataloader(dataset, batch_sampler, total_seq_len: int, hidden_size: int, num_workers: int,
                      num_target_layers: int, preprocess) -> torch.utils.data.DataLoader:
    """13: speculators' `_setup_dataloader`, with the stream's batch sampler in place of its own."""
    from speculators.train.data import CollateFn
    from speculators.train.dataloader import _worker_init_fn

    use_workers = num_workers > 0
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=batch_sampler, num_workers=num_workers, prefetch_factor=4 if use_workers else None,
        pin_memory=True, persistent_workers=use_workers, multiprocessing_context="spawn" if use_workers else None,
        worker_init_fn=_worker_init_fn if use_workers else None,
        collate_fn=CollateFn(total_seq_len, hidden_size, num_target_layers=num_target_layers,
                             dtype=dataset.hidden_states_dtype, preprocess=preprocess))
