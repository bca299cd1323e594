"""The stages by name and where each one's committed output lives on the store (docs/FORMAT.md),
and the one content hash every stored key and digest is made with.

Every module that names a stage or builds a `<run>/<dir>` path asks here: a second spelling of
a stage's directory (`evaluate` is stored as `eval`) or of the hash encoding would make reuse
and promotion silently stop matching what is already committed.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum


class StageName(StrEnum):
    """The pipeline's stages, in order: the names of commands, replicated jobs and `--stages`."""

    CAPTURE = "capture"
    EXTRACT = "extract"
    TRAIN = "train"
    EVALUATE = "evaluate"

    @property
    def dir(self) -> str:
        """The stage's directory under `<run>/` on the store."""
        return "eval" if self is StageName.EVALUATE else self.value


STAGES: tuple[StageName, ...] = tuple(StageName)
VARIANTS = "variants"  # `eagle-jobs compare`: <run>/variants/<name>/{train,eval,epochs} beside the run's own
EPOCHS = "epochs"  # `eagle-jobs rank-epochs`: served tau per epoch checkpoint
COMPARE = "compare"  # `eagle-jobs compare`: the table of every variant
STREAM = "stream"  # train.source stream: what training has finished with, <run>/stream/consumed/<shard>.json


def variant_dir(name: str, variant: str | None = None) -> str:
    """`name` (a stage's dir, epochs) of the run's own draft, or of one compared variant's."""
    return name if variant is None else f"{VARIANTS}/{variant}/{name}"


def train_dir(variant: str | None = None) -> str:
    """Where a run's draft (or one compared variant's) is trained: one extraction, many drafts."""
    return variant_dir(StageName.TRAIN.dir, variant)


def eval_dir(variant: str | None = None) -> str:
    return variant_dir(StageName.EVALUATE.dir, variant)


def epochs_dir(variant: str | None = None) -> str:
    return variant_dir(EPOCHS, variant)


def content_hash(obj, length: int | None = None) -> str:
    """sha256 of obj's canonical JSON (sorted keys, json's default separators), hex, cut to `length`.

    Stored as reuse keys, recipe digests and prompt-set identities: the encoding must never change
    (tests/test_layout.py pins it)."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
    return digest if length is None else digest[:length]
