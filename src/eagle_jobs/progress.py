"""Progress for everything long: items, tokens/s and ETA.

On a terminal, a rich live bar. Elsewhere (a pod's log, CI, a pipe) rich's live display prints
nothing until the stage ends, so there each stage prints plain lines instead: one every
EAGLE_JOBS_PROGRESS_INTERVAL_S seconds (default 30) while it advances, and one at the end.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from eagle_jobs.settings import settings

console = Console(stderr=True)


class TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        toks = task.fields.get("tokens", 0)
        elapsed = task.elapsed or 0.0
        rate = toks / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="cyan")


def _eta(done: int, total: int, elapsed: float) -> str:
    if not done or done >= total:
        return "0:00"
    left = int(elapsed * (total - done) / done)
    if left >= 3600:
        return f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}"
    return f"{left // 60}:{left % 60:02d}"


def progress_line(description: str, done: int, total: int, unit: str, tokens: int, elapsed: float) -> str:
    pct = 100.0 * done / total if total else 100.0
    rate = f", {tokens:,} tokens, {tokens / elapsed:,.0f} tok/s" if tokens and elapsed > 0 else ""
    return (f"  {description}: {done}/{total} {unit} ({pct:.0f}%){rate}, "
            f"elapsed {int(elapsed) // 60}:{int(elapsed) % 60:02d}, ETA {_eta(done, total, elapsed)}")


class PlainTicker:
    """Plain progress lines, at most one per interval, for logs that no live display reaches."""

    def __init__(self, description: str, total: int, unit: str):
        self.description, self.total, self.unit = description, total, unit
        self.interval = settings().progress_interval_s
        self.start = self.printed = time.perf_counter()
        self.done = self.tokens = 0

    def tick(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.printed >= self.interval and self.done < self.total:
            self.printed = now
            self.line()

    def line(self) -> None:
        console.print(progress_line(self.description, self.done, self.total, self.unit, self.tokens,
                                    time.perf_counter() - self.start), soft_wrap=True, markup=False, highlight=False)


@contextmanager
def stage_progress(description: str, total: int, unit: str = "items"):
    """Yields advance(n_items, n_tokens). Every advance is also the pod's progress heartbeat (heartbeat.py)."""
    from eagle_jobs.heartbeat import beat

    beat(force=True)
    if not console.is_terminal:
        ticker = PlainTicker(description, total, unit)

        def tick(n: int = 1, tokens: int = 0) -> None:
            ticker.tick(n, tokens)
            beat()

        yield tick
        ticker.line()
        beat(force=True)
        return
    start = time.perf_counter()
    state = {"tokens": 0}
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn(unit), TaskProgressColumn(), TokensPerSecond(), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total, tokens=0)

        def advance(n: int = 1, tokens: int = 0) -> None:
            state["tokens"] += tokens
            progress.update(task, advance=n, tokens=state["tokens"])
            beat()

        yield advance
    elapsed = time.perf_counter() - start
    if state["tokens"]:
        console.print(f"  {description}: {state['tokens']:,} tokens in {elapsed:.1f}s "
                      f"({state['tokens'] / max(elapsed, 1e-9):,.0f} tok/s)")
