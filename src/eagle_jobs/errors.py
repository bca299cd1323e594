"""Exit codes and the one exception type every stage raises for a clear failure.

Kubernetes maps these (k8s/base/pipeline.yaml podFailurePolicy): BAD_INPUT fails
the index at once (retrying cannot help); everything else is retried.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1  # unexpected: a bug or an unhandled library error (retried)
    USAGE = 2  # command-line usage (typer/click's own code)
    BAD_INPUT = 3  # bad recipe, prompts, shapes or checkpoint: do not retry
    STORE = 4  # store unreachable: missing bucket, bad credentials, bad endpoint
    UNAVAILABLE = 5  # a server never became healthy or kept failing: retry later
    INCOMPATIBLE = 6  # `inspect`: the checkpoint would not load in vLLM
    NOT_READY = 7  # an upstream stage is not committed yet
    NO_CLUSTER = 8  # submit/status/watch/logs: no cluster configuration found, or its API server did not answer
    NOT_BETTER = 9  # `promote`: the candidate does not beat the promoted draft; nothing changed
    NO_SPACE = 10  # a write found its disk full (ENOSPC/EDQUOT): nothing half-written is committed; free space, rerun
    BUSY = 11  # `submit`: a run of the same recipe is still running; nothing applied
    STUCK = 12  # the run's guard: a pod of the run cannot start (image, Secret, vLLM sidecar); the run is failed
    CANCELLED = 130  # ^C (SIGINT): what was committed stays; rerun to resume (128 + 2)
    INTERRUPTED = 143  # SIGTERM: state was committed; rerun to resume (128 + 15)


class EagleJobsError(Exception):
    """A failure with one clear line: what, where, what to do."""

    code: ExitCode = ExitCode.ERROR

    def __init__(self, message: str, code: ExitCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class BadInput(EagleJobsError):
    code = ExitCode.BAD_INPUT


class StoreError(EagleJobsError):
    code = ExitCode.STORE


class Unavailable(EagleJobsError):
    code = ExitCode.UNAVAILABLE


class NotReady(EagleJobsError):
    code = ExitCode.NOT_READY


class Busy(EagleJobsError):
    code = ExitCode.BUSY


class NoCluster(EagleJobsError):
    code = ExitCode.NO_CLUSTER
