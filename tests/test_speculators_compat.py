"""One test per adaptation in eagle_jobs.speculators_compat (pinned to speculators 0.9.0)."""

import importlib.metadata
import time

import pytest
import torch

from eagle_jobs import speculators_compat as compat


def test_pinned_version():
    assert importlib.metadata.version("speculators") == compat.PINNED == "0.9.0"


def test_adaptation_1_device_is_cpu_without_accelerator():
    compat.install()
    assert compat._trainer.get_local_rank() == "cpu"
    torch.nn.Linear(2, 2).to(compat._trainer.get_local_rank())  # what Trainer.setup_model does


def test_adaptation_2_step_timer_needs_no_accelerator():
    """Without an accelerator to synchronize, a mark is the perf_counter clock when it was made and now()
    reads that clock; a disabled timer records nothing and reads no time."""
    compat.install()
    names = ("start", "queue", "pre_h2d", "fetch", "fwd", "pre_clip", "bwd", "opt")
    t = compat._trainer._StepTimer(enabled=True)
    before = time.perf_counter()
    for name in names:
        t.mark(name)
        time.sleep(0.001)
    now = t.now()
    after = time.perf_counter()
    marks = [t._marks[name] for name in names]
    assert before <= marks[0] and all(a < b for a, b in zip(marks, marks[1:])) and marks[-1] < now <= after
    prof = t.profile(10)
    assert prof["step_ms"] == pytest.approx((marks[-1] - marks[0]) * 1000) and prof["step_ms"] >= 7
    assert prof["tokens_per_s"] == pytest.approx(10 / (prof["step_ms"] / 1000))
    off = compat._trainer._StepTimer(enabled=False)
    off.mark("start")
    assert off._marks == {} and off.now() is None and off.profile(10) is None


def test_adaptation_3_checkpoints_load_to_cpu():
    compat.install()
    assert compat._ckpt.get_current_device() == "cpu"


def test_adaptation_4_cpu_trainer_does_not_autocast_to_cuda(monkeypatch):
    # covered end to end in test_train.test_bf16_states_into_fp32_master_draft; here: our override alone.
    def base_init(self, *args, **kwargs):  # speculators 0.9.0 trainer.py:228 without an accelerator
        self.device_type = "cuda"

    monkeypatch.setattr(compat._trainer.Trainer, "__init__", base_init)
    assert not compat.has_accelerator()
    assert compat.StoreTrainer().device_type == "cpu"


@pytest.mark.parametrize("obj", [
    {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2)}},
     "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "foreach": None}]},
    [{"a": [1, 2.5, "x", None, True]}, {"b": torch.arange(3)}],
])
def test_adaptation_5_state_round_trips_without_pickle(obj):
    tensors, tree = compat.state_to_safe(obj)
    back = compat.state_from_safe(tensors, tree)

    def eq(a, b):
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
        return a == b

    assert eq(obj, back)


def test_adaptation_5_export_skips_code_and_pickles(tmp_path):
    d = tmp_path / "3"
    d.mkdir()
    torch.save({"x": torch.ones(2)}, d / "optimizer_state_dict.pt")
    (d / "config.py").write_text("import os")
    (d / "config.json").write_text("{}")
    out = compat.export_checkpoint_dir(d)
    assert set(out) == {"optimizer_state_dict.state.safetensors", "optimizer_state_dict.state.json", "config.json"}
    compat.import_checkpoint_dir(out, tmp_path / "back")
    assert torch.equal(torch.load(tmp_path / "back/optimizer_state_dict.pt", weights_only=True)["x"], torch.ones(2))


def test_adaptation_6_interrupt_saves_current_epoch_and_step():
    saved = []

    class T(compat.StoreTrainer):
        def __init__(self):
            self._cur_epoch, self._cur_step, self.interrupted, self.rank = 2, 5, False, 0
            self._on_checkpoint = lambda e, s: saved.append(("commit", e, s))

    import speculators.train.trainer as tr

    orig = tr.Trainer.maybe_save_checkpoint
    tr.Trainer.maybe_save_checkpoint = lambda self, epoch, local_step=0: saved.append(("save", epoch, local_step))
    try:
        t = T()
        t.maybe_save_checkpoint("interrupted")
    finally:
        tr.Trainer.maybe_save_checkpoint = orig
    assert t.interrupted and saved == [("save", 2, 5), ("commit", 2, 5)]


def test_adaptation_6_signal_is_a_request_honoured_at_the_step_boundary():
    import os
    import signal

    from speculators.train.graceful_shutdown import TrainingInterruptedError

    class T(compat.StoreTrainer):
        def __init__(self):
            self._signalled_at, self.is_distributed, self.steps = None, False, 0

    import speculators.train.trainer as tr

    def loop(self):  # stands in for speculators' epoch loop: the signal arrives mid-step
        for step in range(1, 10):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # torchrun's re-send: the same request
            self.steps = step  # the rest of the step still runs
            if self._stop_agreed():
                raise TrainingInterruptedError("stop")

    orig = tr.Trainer.run_training.__wrapped__
    tr.Trainer.run_training.__wrapped__ = loop
    before = signal.getsignal(signal.SIGTERM)
    try:
        t = T()
        t.maybe_save_checkpoint = lambda label: setattr(t, "saved_after", (label, t.steps))
        t.run_training()  # speculators' wrapper catches the stop and saves
    finally:
        tr.Trainer.run_training.__wrapped__ = orig
    assert t.saved_after == ("interrupted", 3)  # stopped after the step, not inside it
    assert signal.getsignal(signal.SIGTERM) == before  # no handler outlives the call


def test_adaptation_7_gloo_distributed_without_accelerator(monkeypatch):
    import socket

    import torch.distributed as dist
    from speculators.train import distributed as sd

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    compat.setup_distributed()
    try:
        assert dist.get_backend() == "gloo"
        assert (sd.is_distributed(), sd.get_rank(), sd.get_world_size(), sd.get_dp_size()) == (True, 0, 1, 1)
        flag = torch.ones(1)
        dist.all_reduce(flag)  # a collective works on CPU tensors
    finally:
        sd.maybe_destroy_distributed()
    assert not sd.is_distributed()


def test_adaptation_9_lk_hybrid_eta_is_bound_and_nothing_else_changes():
    from speculators.losses import eager, fused, resolve_loss_config

    for impl in ("eager", "fused"):
        cfg = resolve_loss_config('{"lk_hybrid": 0.5, "kl_div": 0.5}', impl)
        assert compat.with_loss_parameters(cfg) is cfg  # no eta: speculators' config as resolved
        bound = compat.with_loss_parameters(cfg, eta=1.5)
        assert bound["kl_div"] == cfg["kl_div"] and bound["lk_hybrid"][1] == 0.5
        assert bound["lk_hybrid"][0].func is cfg["lk_hybrid"][0] and bound["lk_hybrid"][0].keywords == {"eta": 1.5}
    logits, targets = torch.randn(1, 8, 32), torch.randn(1, 8, 32)
    bound = compat.with_loss_parameters(resolve_loss_config("lk_hybrid", "eager"), eta=1.5)["lk_hybrid"][0]
    torch.testing.assert_close(bound(logits, targets), eager.lk_hybrid_loss(logits, targets, eta=1.5))
    assert fused.fused_lk_hybrid_loss.__defaults__ == (3.0,)  # what an unbound spec gets


def test_adaptation_14_muon_orthogonalises_in_fp32_on_cpu_to_torchs_result():
    """torch's Newton-Schulz in bf16 and ours in fp32 agree to bf16's precision; a Muon step on CPU runs ours."""
    compat.install()
    from torch.optim import _muon

    assert _muon._zeropower_via_newtonschulz is compat.newton_schulz_fp32
    torch.manual_seed(0)
    for shape in [(64, 192), (192, 64)]:
        g = torch.randn(shape)
        ours = compat.newton_schulz_fp32(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
        theirs = compat.TORCH_NEWTON_SCHULZ(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == g.shape
        torch.testing.assert_close(ours.float(), theirs.float(), atol=0.02, rtol=0.02)
        # orthogonalised: singular values near 1 (Muon's quintic leaves them in about [0.7, 1.2])
        s = torch.linalg.svdvals(ours.float())
        assert 0.5 < float(s.min()) and float(s.max()) < 1.3
    w = torch.nn.Parameter(torch.randn(8, 16))
    w.grad = torch.randn(8, 16)
    before = w.detach().clone()
    torch.optim.Muon([w], lr=0.1).step()
    assert not torch.equal(w.detach(), before)


def test_adaptation_12_fused_loss_kernels_hold_their_own_autotune_configs():
    """speculators 0.9.0 hands its forward and backward loss kernels one triton.autotune object, so
    both share one `configs` list, which torch 2.11's dynamo refused under compile on an H200."""
    triton = pytest.importorskip("triton")  # make venv installs it with torch; without it, no fused loss at all
    from speculators.losses import fused

    kernels = [k for k in vars(fused).values() if isinstance(k, triton.runtime.Autotuner)]
    before = [[c.kwargs for c in k.configs] for k in kernels]
    compat.unshare_autotune_configs()
    assert len(kernels) >= 2 and len({id(k.configs) for k in kernels}) == len(kernels)
    assert [[c.kwargs for c in k.configs] for k in kernels] == before  # the same candidates, each its own list
