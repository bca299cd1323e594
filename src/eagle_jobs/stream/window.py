"""The stream's window and markers on the store (eagle_jobs.stream): extraction's wait while the window is
full, the shards training has consumed, training's waiting and alive marks, a failed extraction's mark."""


from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from eagle_jobs.committed import extract_manifest
from eagle_jobs.errors import BadInput, EagleJobsError
from eagle_jobs.layout import STREAM, StageName
from eagle_jobs.poll import poll_until
from eagle_jobs.progress import console
from eagle_jobs.records import ExtractManifest
from eagle_jobs.store import Stage, Store
from eagle_jobs.stream.plan import StreamShard, mib

GROUP_SHARE, CHECKPOINT_SHARE = 8, 4  # a shuffle group <= W/8; a checkpoint once W/4 is finished with
POLL_S = 1.0  # how often a waiting side looks at the store again
REPORT_S = 30.0  # and how often it says that it is still waiting
RECOUNT_S = 60.0  # extraction counts the window's bytes at least this often (Window.wait)
ALIVE_EVERY_S = 60.0  # training's rank 0 marks itself alive on the store this often (TrainingAlive)
TRAINING_STALE_S = 1800.0  # a window wait ends once training's mark is this old: the window will not drain


def check_window(window: int, step_bytes: int) -> None:
    """Training: one optimizer step's states (all ranks) must be at most an eighth of the window."""
    if window < GROUP_SHARE * step_bytes:
        raise BadInput(f"store.window_bytes {window:,} is below {GROUP_SHARE} x one step's states ({step_bytes:,} "
                       "bytes: the longer of train.total_seq_len and limits.max_seq_len, x bytes per token x ranks): "
                       "raise the window")


# -- consumption --------------------------------------------------------------------
def consumed_key(run_id: str, shard: str = "") -> str:
    return f"{run_id}/{STREAM}/consumed/{shard}.json" if shard else f"{run_id}/{STREAM}/consumed"


def consumed(store: Store, run_id: str) -> set[str]:
    """Shards training has finished with (their data deleted in re-extract mode)."""
    return {k.rsplit("/", 1)[1].removesuffix(".json") for k in store.list(consumed_key(run_id))
            if k.endswith(".json")}


def unfinished(stage: Stage, shards: Sequence[StreamShard]) -> list[StreamShard]:
    """The shards a (restarted) extractor still has to commit: neither committed nor consumed.

    Committed first, consumed second: training writes the consumed marker before it deletes the data
    (`mark_consumed`), so a shard whose data goes between the two reads is in the second. Read the other
    way round, such a shard was neither, and extracted and committed again beside a running trainer
    (tests/test_stream.py)."""
    committed = stage.committed_names()
    pending = [s for s in shards if s.name not in committed]
    done = consumed(stage.store, stage.run_id)
    return [s for s in pending if s.name not in done]


def mark_consumed(store: Store, run_id: str, shards: Sequence[StreamShard], delete: bool, at: dict) -> None:
    """Every marker first, then the deletes: a crash between them leaves a consumed shard's bytes, never a
    missing shard that is not marked (which a restarted extractor would redo)."""
    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    store.put_many({consumed_key(run_id, s.name): store.json_bytes({"shard": s.name, "deleted": delete, **at})
                    for s in shards})  # thousands at a checkpoint of the Kimi recipe: written together
    if delete:
        store.delete_many([stage.key(f"data/{s.fname}") for s in shards])


def is_validation(manifest: ExtractManifest) -> bool:
    """A stream's validation shard: kept for every epoch's validation, outside the window."""
    return bool(manifest["samples"]) and all(e["split"] == "validation" for e in manifest["samples"])


def waiting_key(run_id: str) -> str:
    return f"{run_id}/{STREAM}/training-waits.json"


def mark_waiting(store: Store, run_id: str, shard: str) -> None:
    """Training: the shard it is blocked on (a stale mark names a committed shard, and lets nothing through)."""
    store.put_json(waiting_key(run_id), {"shard": shard, "at": time.time()})


def stored_bytes(store: Store, run_id: str) -> int:
    """What the extraction's data objects take on the store now (what `peak store use` measures)."""
    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    total = 0
    for k in store.list(stage.key("data")):
        try:
            total += store.size(k)
        except FileNotFoundError:  # deleted between the listing and the stat
            pass
    return total


class Window:
    """Extraction's side of the window: waits while committing the next shard would put the committed,
    unconsumed training shards over `window` bytes, unless training is blocked on that shard or a later
    one. With several extraction workers the shards do not commit in the stream's order: workers that
    started earlier can fill the window with shards training cannot use yet, and the worker holding the
    shard training needs must still commit it (peak: the window plus that shard, one per worker)."""

    def __init__(self, store: Store, run_id: str, window: int, order: Sequence[StreamShard]):
        self.store, self.run_id, self.window = store, run_id, window
        self.stage = Stage(store, run_id, StageName.EXTRACT.dir)
        self.position = {s.name: i for i, s in enumerate(order)}
        # a shard's bytes as planned (its tokens x bytes per token), validation shards 0: no GET per
        # manifest (a restarted worker of the Kimi recipe would read 50,000); a name outside the plan is
        # read once
        self._sizes: dict[str, int] = {s.name: 0 if s.split == "validation" else s.planned_bytes for s in order}
        self._counted: tuple[int, float, int] | None = None  # (live at the last count, when, committed since)
        self.started = time.time()  # this worker's start: a trainer that marked itself alive before it is older

    def live(self) -> int:
        """Bytes of committed training shards training has not finished with (validation shards are kept
        for every epoch's validation, on top of the window)."""
        names = [k.rsplit("/", 1)[1].removesuffix(".json") for k in self.store.list(self.stage.key("manifests"))]
        for n in names:
            if n not in self._sizes and (m := extract_manifest(self.stage, n)) is not None:
                self._sizes[n] = 0 if is_validation(m) else sum(f["size"] for f in m["files"].values())
        done = consumed(self.store, self.run_id)
        return sum(self._sizes.get(n, 0) for n in names if n not in done)

    def needed(self, shard: str) -> bool:
        try:
            blocked = self.store.get_json(waiting_key(self.run_id))["shard"]
        except FileNotFoundError:
            return False
        return blocked in self.position and self.position[shard] <= self.position[blocked]

    def wait(self, shard: str, nbytes: int, say: Callable[[str], None] = console.print) -> None:
        """Until the shard fits. A wait for training is progress: it beats the worker's heartbeat, so the
        liveness probe does not kill a worker whose trainer starts late or checkpoints slowly.

        `live` lists every manifest and consumed marker: at the Kimi recipe's 50,000 shards, a hundred LIST
        pages. So while the last count, plus what this worker committed since, leaves an eighth of the
        window free, and is younger than RECOUNT_S, the shard goes without a count: the other workers'
        commits since the count (seconds of extraction each) are within that eighth."""
        now = time.monotonic()
        if self._counted is not None:
            live, at, mine = self._counted
            if now - at < RECOUNT_S and live + mine + nbytes <= self.window - self.window // GROUP_SHARE:
                self._counted = (live, at, mine + nbytes)
                return
        counted = [0]

        def fits() -> int | None:
            counted[0] = live = self.live()
            return live if not live or live + nbytes <= self.window or self.needed(shard) else None

        def still_full(waited: float) -> None:  # a GET of the trainer's mark per report, not per look
            check_training_alive(self.store, self.run_id, self.started)
            say(f"  window full: {mib(counted[0])} of {mib(self.window)} not yet trained on; "
                f"waiting for training ({waited:.0f} s)")

        live = poll_until(fits, still_full, every_s=POLL_S, report_s=REPORT_S)
        self._counted = (live, time.monotonic(), nbytes)


# -- a failure on one side, seen by the other ------------------------------------------------
def alive_key(run_id: str) -> str:
    return f"{run_id}/{STREAM}/training-alive.json"


class TrainingAlive:
    """Training's rank 0 rewrites `<run>/stream/training-alive.json` every ALIVE_EVERY_S from a daemon thread
    while its process lives: an extraction worker waiting on a full window tells a trainer that is slow
    (it waits) from one that is gone (check_training_alive)."""

    def __init__(self, store: Store, run_id: str):
        import threading

        self.store, self.run_id, self._stop = store, run_id, threading.Event()
        self.started_at = time.time()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            try:
                self.store.put_json(alive_key(self.run_id), {"at": time.time(), "started_at": self.started_at})
            except Exception:  # noqa: BLE001 - a missed mark is retried; the trainer's own reads fail loudly
                pass
            if self._stop.wait(ALIVE_EVERY_S):
                return

    def start(self) -> "TrainingAlive":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def check_training_alive(store: Store, run_id: str, since: float, stale_s: float = TRAINING_STALE_S) -> None:
    """Extraction, waiting for training to free the window: fail (exit 5, retried) once a trainer that started
    after this worker (`since`) marked itself alive and then not for `stale_s`: a window nobody drains never
    frees. A trainer that has not started yet (its node, its image pull) is waited for, as the stage's
    deadline allows, and so is the mark of one that started before this worker: an earlier attempt's, whose
    successor has not started yet."""
    from eagle_jobs.errors import Unavailable

    try:
        mark = store.get_json(alive_key(run_id))
    except FileNotFoundError:
        return
    at = float(mark["at"])
    if float(mark.get("started_at", at)) >= since and time.time() - at > stale_s:
        raise Unavailable(f"stream: training of run '{run_id}' last marked itself alive {time.time() - at:.0f} s "
                          f"ago (> {stale_s:.0f} s) and the window is full: nothing will drain it; failing so the "
                          "run restarts (training resumes at its last checkpoint)")


def failed_key(run_id: str) -> str:
    return f"{run_id}/{STREAM}/extract-failed.json"


def mark_failed(store: Store, run_id: str, error: str) -> None:
    store.put_json(failed_key(run_id), {"error": error, "at": time.time()})


def clear_failed(store: Store, run_id: str) -> None:
    store.delete(failed_key(run_id))


def committed_in_order(store: Store, run_id: str, names: Sequence[str]) -> Iterator[ExtractManifest]:
    """The manifests of `names`, each once extraction commits it, quietly (train.data.ShardStager's
    source: the trainer's own reads say where the stream is). Ends at a failed extraction or at a
    shard a completed extraction does not hold; training itself reports both."""
    stage = Stage(store, run_id, StageName.EXTRACT.dir)
    end = cast(ExtractManifest, {})  # what a look returns when the stream ends without the shard

    def look(name: str) -> ExtractManifest | None:
        if store.exists(failed_key(run_id)):
            return end
        done = stage.is_complete()  # before the manifest's second look: it may commit in between
        m = extract_manifest(stage, name)
        return m if m is not None else (end if done else None)

    for name in names:
        m = extract_manifest(stage, name)
        if m is None:
            m = poll_until(functools.partial(look, name), every_s=POLL_S, report_s=REPORT_S)
        if m is end:
            return
        yield m


def check_not_failed(store: Store, run_id: str) -> None:
    try:
        err = store.get_json(failed_key(run_id))
    except FileNotFoundError:
        return
    raise EagleJobsError(f"train: extraction of run '{run_id}' failed while streaming ({err['error']}); "
                         "fix it and rerun: training resumes at its last checkpoint")
