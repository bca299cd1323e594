"""poll_until, the one loop every stream wait goes through: between looks it checks for failure, beats the
heartbeat and reports, on the first wait and then at its cadence; a failure ends the wait."""

from __future__ import annotations

import pytest

from eagle_jobs import heartbeat
from eagle_jobs.errors import Unavailable
from eagle_jobs.poll import poll_until


def test_it_returns_the_first_ready_value_and_says_on_the_first_wait_then_at_its_cadence(tmp_path, monkeypatch):
    beat_file = tmp_path / "beat"
    monkeypatch.setenv(heartbeat.ENV, str(beat_file))
    monkeypatch.setattr(heartbeat, "_last", float("-inf"))
    looks, said, checks = iter([None, None, None, 0]), [], []
    assert poll_until(lambda: next(looks), said.append, lambda: checks.append(1), every_s=0.01, report_s=3600) == 0
    assert len(checks) == 3 and len(said) == 1 and said[0] >= 0  # 0 is ready: only None means not yet
    assert beat_file.exists()  # a wait is progress
    said.clear()
    looks = iter([None, None, "x"])
    assert poll_until(lambda: next(looks), said.append, every_s=0.01, report_s=0) == "x"
    assert len(said) == 2


def test_a_failure_ends_the_wait_and_a_ready_first_look_never_waits():
    def failed():
        raise Unavailable("the other side is gone")

    with pytest.raises(Unavailable, match="gone"):
        poll_until(lambda: None, failed=failed, every_s=0.01, report_s=1)
    assert poll_until(lambda: "now", lambda _: pytest.fail("said"), failed, every_s=60, report_s=60) == "now"
