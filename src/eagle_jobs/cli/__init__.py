"""`eagle-jobs`: one sub-command per stage, `run` for a whole recipe.

Every failure we can name ends in one line on stderr and an exit code from
eagle_jobs.errors.ExitCode (documented in docs/OPERATIONS.md#exit-codes).
Each module registers its commands on `app` when imported, in the order `--help` lists them.
"""

# isort: off
from eagle_jobs.cli import stages  # noqa: F401 - the pipeline's commands
from eagle_jobs.cli import cluster  # noqa: F401 - the cluster's
from eagle_jobs.cli import pod  # noqa: F401 - the pods' own, hidden
# isort: on
from eagle_jobs.cli.app import app, main

__all__ = ["app", "main"]
