"""store:<key> references: an object of the run's own store named without its bucket."""

from __future__ import annotations

from pathlib import Path

from eagle_jobs.errors import BadInput

# A recipe or a command names an object of the run's own store as store:<key> (store:models/<org>/<name>/
# <revision>, store:prompts/<file>.jsonl, store:drafts/<name>): the bucket is then written once, as the store
# setting ($EAGLE_JOBS_STORE, --store, or the recipe's store.uri), and every reference follows it.
STORE_REF = "store:"


def normalized_uri(uri: str) -> str:
    """A store URI as Store.open names it: a bare or file:// path made absolute, no trailing '/'."""
    if "://" not in uri:
        uri = "file://" + uri
    protocol, _, rest = uri.partition("://")
    if protocol == "file":
        return "file://" + str(Path(rest).absolute()).rstrip("/")
    return uri.rstrip("/")


def resolve_ref(value: str, store_uri: str | None) -> str:
    """`value` with a store:<key> reference turned into <store>/<key>; anything else as it is."""
    if not value.startswith(STORE_REF):
        return value
    key = value.removeprefix(STORE_REF).strip("/")
    if not key or ".." in key.split("/"):
        raise BadInput(f"'{value}' names no object of the store: write store:<key>, e.g. store:models/<name>")
    if not store_uri:
        raise BadInput(f"'{value}' is a store reference and no store is set: pass --store or set "
                         "$EAGLE_JOBS_STORE (s3://<bucket> or file://<dir>)")
    return f"{normalized_uri(store_uri)}/{key}"
