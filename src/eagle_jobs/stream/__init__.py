"""Streaming (`train.source: stream`): training reads extraction's shards in commit order while
extraction goes on, and the store holds at most `store.window_bytes` of states training has not
finished with. The layer below extract and train, which never import each other:

- both plan the same shards from the same committed rows (`StreamPlan`): validation shards
  first (kept: each epoch's validation reads them), then the training shards, then, with
  `train.later_epochs: re-extract`, the training shards again under a pass suffix for each later
  epoch (prefill again, no generation);
- training marks a shard consumed (`<run>/stream/consumed/<shard>.json`) once a committed
  checkpoint is past its last sample, and in re-extract mode deletes its data then: a restarted
  trainer resumes at that checkpoint and never needs a deleted shard;
- extraction pauses while the committed, unconsumed shards fill the window (`Window.wait`),
  and a restarted extractor skips consumed shards as it skips committed ones.

The window's budget, W = store.window_bytes, so that neither side waits on the other for ever:
training shuffles within groups of consecutive shards of at most W/8 (GROUP_SHARE) and asks for a
checkpoint once the groups it has finished since the last one hold W/4 (CHECKPOINT_SHARE). When
training waits for a shard, the window holds at most what awaits a checkpoint (< W/4) and the groups
the current step touches (one step's states plus a group at each end: <= 3W/8), so extraction can
commit its next shard when a shard and a step's states are each at most W/8: the recipe checks
shards (recipe.WINDOW_SHARDS), training checks steps (`check_window`).
"""

from eagle_jobs.stream.plan import (  # noqa: F401
    StreamPlan,
    StreamShard,
    mib,
    num_workers_of,
    pass_name,
    worker_stream,
)
from eagle_jobs.stream.window import (  # noqa: F401
    ALIVE_EVERY_S,
    CHECKPOINT_SHARE,
    GROUP_SHARE,
    POLL_S,
    RECOUNT_S,
    REPORT_S,
    TRAINING_STALE_S,
    TrainingAlive,
    Window,
    alive_key,
    check_not_failed,
    check_training_alive,
    check_window,
    clear_failed,
    committed_in_order,
    consumed,
    consumed_key,
    failed_key,
    is_validation,
    mark_consumed,
    mark_failed,
    mark_waiting,
    stored_bytes,
    unfinished,
    waiting_key,
)
