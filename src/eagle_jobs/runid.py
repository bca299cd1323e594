"""Run ids: one rule, checked wherever a run id comes in, before anything is written.

A run id is a path segment of the store (<store>/<run id>/<stage>/...: on file:// a directory, on S3
a key prefix) and, through `submit`, names the JobSet eagle-jobs-<run id> (cluster.jobset_name). So it
is a short name: letters, digits, '-', '_' and '.', starting and ending with a letter or digit, with
no '..' (which also rules out '/', '.', '..' and anything that climbs out of the store's root or prefix).

At most 33 characters: JobSet's webhook (kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go,
ValidateCreate, v0.12.0) checks the longest pod name <jobset>-<replicatedJob>-<jobIdx>-<podIdx>-<5
random> as an RFC-1035 label of at most 63 characters, which leaves the JobSet name 44 (cluster.
MAX_JOBSET_NAME) and the run id 44 - len("eagle-jobs-"). The same limit everywhere, so that a run id
that works on a laptop also works on a cluster. cluster.jobset_name lowercases it and turns '.' and
'_' into '-': any run id this module admits becomes a valid RFC-1035 label there.
"""

from __future__ import annotations

import re

from eagle_jobs.errors import BadInput

MAX_LENGTH = 33
# The store's own prefixes beside its runs (store:models/..., store:prompts/..., store:drafts/...: eagle_jobs/
# store.py): a run of one of these names would mix its stages into the mirrored weights, prompts or drafts.
RESERVED = frozenset({"models", "prompts", "drafts"})
_SHAPE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def run_id_problem(value: object) -> str | None:
    """What is wrong with a run id, or None."""
    if not isinstance(value, str) or not value:
        return "is empty" if value in ("", None) else "is not a string"
    if len(value) > MAX_LENGTH:
        return (f"is too long: {len(value)} characters, at most {MAX_LENGTH} (it also names the JobSet "
                "eagle-jobs-<run id>, which JobSet limits to 44)")
    if "/" in value or "\\" in value:
        return "contains a path separator: it is one directory (or key prefix) of the store"
    if ".." in value:
        return "contains '..'"
    if not _SHAPE.fullmatch(value):
        return "may hold only letters, digits, '-', '_' and '.', and must start and end with a letter or digit"
    if value in RESERVED:
        return f"is one of the store's own prefixes ({', '.join(sorted(RESERVED))})"
    return None


def check_run_id(value: str, where: str) -> str:
    """value, if it is a run id; else BadInput (exit 3) naming where it came from."""
    problem = run_id_problem(value)
    if problem:
        raise BadInput(f"run id {value!r} ({where}) {problem}: use a short name such as demo-2 or ci-123")
    return value
