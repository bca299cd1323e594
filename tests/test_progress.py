"""Progress where nobody watches a terminal: a pod's log, CI, a pipe."""

from __future__ import annotations

import re

from eagle_jobs.progress import progress_line, stage_progress


def test_off_a_terminal_lines_come_while_the_stage_runs_not_only_at_its_end(capsys, monkeypatch):
    """rich's live display writes nothing to a non-terminal until it stops: a 3-day capture would be
    silent for 3 days. Off a terminal each stage prints plain lines as it goes."""
    monkeypatch.setenv("EAGLE_JOBS_PROGRESS_INTERVAL_S", "0")
    with stage_progress("capture", 4, "conversations") as advance:
        advance(1, 100)
        advance(1, 100)
        during = capsys.readouterr().err  # before the stage ends
        advance(2, 200)
    after = capsys.readouterr().err
    assert re.search(r"capture: 1/4 conversations \(25%\), 100 tokens, [\d,]+ tok/s, elapsed 0:00, ETA \d+:\d\d",
                     during)
    assert "capture: 2/4 conversations (50%)" in during
    assert "capture: 4/4 conversations (100%), 400 tokens" in after and "ETA 0:00" in after
    assert "\x1b[" not in during + after  # no terminal control codes in a log


def test_lines_are_rate_limited_by_the_interval(capsys, monkeypatch):
    monkeypatch.setenv("EAGLE_JOBS_PROGRESS_INTERVAL_S", "3600")
    with stage_progress("extract", 1000, "rows") as advance:
        for _ in range(999):
            advance(1, 10)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "extract: 999/1000 rows" in lines[0]  # only the closing line


def test_eta_is_the_remaining_share_of_the_elapsed_time():
    assert progress_line("train", 1, 4, "steps", 0, 60.0).endswith("elapsed 1:00, ETA 3:00")
    assert progress_line("train", 1, 100, "steps", 0, 3600.0).endswith("ETA 99:00:00")
