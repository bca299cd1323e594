"""train.source stream, training's side: waiting for the shards extraction is still committing, the
shuffle groups of consecutive shards, and `StreamFeed`, which says when a checkpoint is due and marks
the shards training is past consumed.

Imports nothing of the train package: data.py's datasets (which speculators' spawned loader workers
import) wait here for their shards.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from eagle_jobs.committed import extract_manifest
from eagle_jobs.layout import StageName
from eagle_jobs.poll import poll_until
from eagle_jobs.progress import console
from eagle_jobs.records import ExtractManifest
from eagle_jobs.store import Stage, Store
from eagle_jobs.stream import window as stream_window
from eagle_jobs.stream.plan import num_workers_of, pass_name


def wait_committed(store: Store, run_id: str, shard: str, order: list[str]) -> ExtractManifest:
    """The manifest of `shard` once extraction commits it; says where training is in the stream."""
    from eagle_jobs.errors import BadInput

    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    pos, marked = order.index(shard), False

    def failed() -> None:
        nonlocal marked
        stream_window.check_not_failed(store, run_id)
        if not marked:  # extraction lets the shard training is blocked on through a full window
            stream_window.mark_waiting(store, run_id, shard)
            marked = True
        if stage.is_complete() and stage.manifest(shard) is None:
            raise BadInput(f"train: extraction of run '{run_id}' completed without shard {shard} of the stream "
                           "plan: were the rows or the recipe changed? rerun extract with this recipe")

    def say(waited: float) -> None:
        have = len(stage.store.list(stage.key("manifests")))
        console.print(f"  stream: training waits for shard {pos + 1} of {len(order)} ({shard}); extraction "
                      f"has committed {have} ({waited:.0f} s)", markup=False, highlight=False)

    # waiting for extraction is progress: poll_until beats the heartbeat (Window.wait)
    m = poll_until(lambda: extract_manifest(stage, shard), say, failed, every_s=stream_window.POLL_S,
                   report_s=stream_window.REPORT_S)
    have = len(stage.store.list(stage.key("manifests")))
    console.print(f"  stream: reading shard {pos + 1} of {len(order)}; extraction has committed {have}, "
                  f"{max(0, have - pos - 1)} ahead of training", markup=False, highlight=False)
    return m


def first_worker_count(store: Store, run_id: str) -> int:
    """The extraction's worker count, from its first committed shard's name (waits for one)."""

    stage = Stage(store, run_id, StageName.EXTRACT.dir)

    def say(waited: float) -> None:  # a verifier can take an hour to load
        console.print(f"  stream: waiting for extraction's first shard ({waited:.0f} s)", markup=False)

    keys = poll_until(lambda: stage.store.list(stage.key("manifests")) or None, say,
                      lambda: stream_window.check_not_failed(store, run_id), every_s=stream_window.POLL_S,
                      report_s=stream_window.REPORT_S)
    first = keys[0].rsplit("/", 1)[1].removesuffix(".json")
    wait_committed(store, run_id, first, [first])
    return num_workers_of(first)


def stream_groups(shards: list, group_bytes: int) -> list[list]:
    """Consecutive shards, each group at most group_bytes (at least one shard): shuffled within, and
    finished with (consumed) together."""
    groups: list[list] = []
    size = 0
    for s in shards:
        if not groups or (groups[-1] and size + s.planned_bytes > group_bytes):
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.planned_bytes
    return groups


@dataclass
class StreamFeed:
    """Training's side of the window. Every rank asks `checkpoint_due` after each step (the same answer on
    all: it is computed from the plan): a checkpoint is due once the groups finished since the last one
    hold a quarter of the window (eagle_jobs.stream: the window's budget). Rank 0, once a checkpoint
    is committed, marks the shards it is past consumed (re-extract: deletes them), so a restart never
    needs a shard that is gone."""

    store: Store
    run_id: str
    sampler: object
    groups: list[list]
    reextract: bool
    window: int
    marked: set[str]
    _base: tuple[int, int] = (-1, 0)  # (epoch, groups done) at the last checkpoint this feed asked for
    first_step_at: float | None = None  # when this process's first step ended (the overlap with extraction)
    _bytes_before: list[int] = field(default_factory=list)  # planned bytes of groups[:i], built once

    def __post_init__(self) -> None:
        self._bytes_before = list(itertools.accumulate((sum(s.planned_bytes for s in g) for g in self.groups),
                                                       initial=0))

    def _pass(self, epoch: int) -> int:
        return epoch if self.reextract else 0

    def _groups_done(self, epoch: int, steps: int) -> int:
        if not self.reextract and epoch > 0:
            return len(self.groups)
        return self.sampler.groups_done(epoch, steps)  # type: ignore[attr-defined]

    def checkpoint_due(self, epoch: int, step: int) -> bool:
        self.first_step_at = self.first_step_at or time.time()
        if self._base[0] != epoch:  # the first step of this process in the epoch: the last checkpoint is its start
            self._base = (epoch, self._groups_done(epoch, step - 1))
        done = self._groups_done(epoch, step)
        from eagle_jobs.stream import CHECKPOINT_SHARE

        if self._bytes_before[done] - self._bytes_before[self._base[1]] < self.window // CHECKPOINT_SHARE:
            return False
        self._base = (epoch, done)
        return True

    def on_commit(self, epoch: int, local_step: int) -> None:
        from dataclasses import replace


        done = self._groups_done(epoch, local_step or 1 << 62)  # local step 0: the epoch's end
        p = self._pass(epoch)
        new = [replace(s, name=pass_name(s.name, p)) for g in self.groups[:done] for s in g]
        new = [s for s in new if s.name not in self.marked]
        if new:
            stream_window.mark_consumed(self.store, self.run_id, new, self.reextract,
                                        {"epoch": epoch, "step": local_step})
            self.marked.update(s.name for s in new)
