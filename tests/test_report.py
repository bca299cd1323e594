"""The report a person reads: smoothed curves, held-out points, the exported epoch's estimate."""

from eagle_jobs.evaluate.run import teacher_forced_estimate
from eagle_jobs.report import _epoch_end_steps, _validation, ema, write_report

METRICS = [
    *({"train": {"loss": 10.0 - s % 7, "full_acc_0": 0.1 * (s % 5)}, "epoch": s // 4, "global_step": s}
      for s in range(8)),
    {"val": {"loss_epoch": 5.0, "full_acc_0_epoch": 0.4, "full_acc_1_epoch": 0.2}, "epoch": 0},
    {"val": {"loss_epoch": 4.0, "full_acc_0_epoch": 0.3, "full_acc_1_epoch": 0.1}, "epoch": 1},
]


def test_ema_smooths_and_starts_at_the_first_value():
    raw = [0.0, 10.0, 0.0, 10.0, 0.0, 10.0]
    smooth = ema(raw, alpha=0.1)
    assert smooth[0] == 0.0 and abs(smooth[1] - 1.0) < 1e-9
    assert max(smooth) - min(smooth) < max(raw) - min(raw) and len(smooth) == len(raw)


def test_validation_points_sit_at_each_epochs_last_step():
    assert _epoch_end_steps(METRICS) == {0: 3, 1: 7}
    assert _validation(METRICS, "loss") == [(0, 5.0), (1, 4.0)]


def test_the_estimate_is_the_exported_epochs_not_the_last():
    assert abs(teacher_forced_estimate(METRICS, 2, epoch=0) - 1.6) < 1e-9
    assert abs(teacher_forced_estimate(METRICS, 2) - 1.4) < 1e-9  # no selection: the last validated epoch
    report = {"num_speculative_tokens": 2, "per_position_acceptance": [0.3, 0.1], "acceptance_length": 1.4,
              "run_id": "r", "verifier": "v", "draft": "d", "num_prompts": 1, "prompts": "p",
              "tokens_generated": 1, "verifier_forwards": 1, "backend": "vllm",
              "teacher_forced_estimate": teacher_forced_estimate(METRICS, 2, epoch=0),
              "train": {"selection": {"epoch": 0, "by": "best estimate", "last_epoch": 1,
                                      "per_epoch": {"0": 1.6, "1": 1.4}}}}
    files = write_report(report, METRICS)
    md = files["report.md"].decode()
    assert "| teacher-forced estimate of the exported epoch (training metrics) | 1.600 |" in md
    assert "| checkpoint | epoch 0 of 2: best estimate |" in md
    assert files["training.png"][:4] == b"\x89PNG"


def test_training_and_the_report_estimate_tau_by_one_rule():
    """committed.tau_estimate: 1 + the validated full_acc_i below k; training's epoch choice and the report's
    teacher-forced figure both read it, so they agree wherever both see the same validation."""
    from eagle_jobs.committed import tau_estimate
    from eagle_jobs.evaluate.run import teacher_forced_estimate
    from eagle_jobs.train.checkpoints import select_epoch

    val = {"full_acc_0_epoch": 0.5, "full_acc_1_epoch": 0.25, "full_acc_2_epoch": 0.125}
    assert tau_estimate(val, 2) == 1.75 and tau_estimate(val, 3) == 1.875
    assert tau_estimate(val, 5) == 1.875  # k beyond the validated steps: the steps validated
    assert tau_estimate({"loss": 1.0}, 3) is None
    metrics = [{"epoch": 0, "val": {**val, "full_acc_0_epoch": 0.1}}, {"epoch": 1, "val": val}]
    sel = select_epoch(metrics, 3, 1)
    assert sel["epoch"] == 1 and sel["tau_estimate"] == teacher_forced_estimate(metrics, 3, 1) == 1.875
