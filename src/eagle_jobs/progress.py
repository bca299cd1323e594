"""Rich progress for everything long: items, tokens/s and ETA."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TaskProgressColumn,
    TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)
from rich.text import Text

console = Console(stderr=True)


class TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        toks = task.fields.get("tokens", 0)
        elapsed = task.elapsed or 0.0
        rate = toks / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="cyan")


@contextmanager
def stage_progress(description: str, total: int, unit: str = "items"):
    """Yields advance(n_items, n_tokens)."""
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn(unit), TaskProgressColumn(), TokensPerSecond(), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False,
    )
    start = time.perf_counter()
    with progress:
        task = progress.add_task(description, total=total, tokens=0)
        state = {"tokens": 0}

        def advance(n: int = 1, tokens: int = 0) -> None:
            state["tokens"] += tokens
            progress.update(task, advance=n, tokens=state["tokens"])

        yield advance
    elapsed = time.perf_counter() - start
    if state["tokens"]:
        console.print(f"  {description}: {state['tokens']:,} tokens in {elapsed:.1f}s "
                      f"({state['tokens'] / max(elapsed, 1e-9):,.0f} tok/s)")
