"""train's record: final/'s train_config.json and the selection in it (docs/FORMAT.md "train"). Imported
through eagle_jobs.records."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class Selection(TypedDict):
    """train_config.json's `selection`: which epoch final/ holds and why (train.checkpoints.select_epoch;
    eagle_jobs.epochs rewrites it as the served choice, with the fields FORMAT.md names)."""

    epoch: int
    by: str
    last_epoch: NotRequired[int]  # absent where no held-out samples chose it
    tau_estimate: NotRequired[float | None]
    per_epoch: NotRequired[dict]  # epoch -> the held-out tau estimate
    # train.select_by: served (eagle_jobs.epochs.select_served)
    selected_by: NotRequired[str]
    served_tau: NotRequired[float]
    per_epoch_served: NotRequired[dict]
    spearman: NotRequired[float | None]
    served_ranking_wall_s: NotRequired[float]
    report: NotRequired[str]
    estimate_selection: NotRequired[Selection | None]  # the selection training made


class TrainRecord(TypedDict):
    """final/'s train_config.json (docs/FORMAT.md "train"): what a draft was trained on and with. `metrics`
    is stored beside it, as metrics.json."""

    run_id: str
    verifier: str
    samples: dict[str, int]  # train, validation
    epochs: int
    lr: float
    scheduler: str
    optimizer: str
    world_size: int
    steps_per_epoch: int
    total_steps: int
    parameters: dict[str, int]
    draft_shape: str
    aux_layer_ids: list[int]
    attention: str
    loss_implementation: str
    hidden_states_dtype: str
    recipe_digest: str
    vocab_coverage: float
    image_digests: dict[str, str]
    stream: NotRequired[dict]  # train.source stream: first step, shards consumed
    selection: NotRequired[Selection]
    train_seconds: NotRequired[float]
    metrics: NotRequired[list[dict]]
