"""A recipe file as every command reads it: YAML, checked by the schema (eagle_jobs/recipe/), with the values
the schema derives from the verifier's config filled in.

Apart from the schema because the derivation reads the verifier's config (eagle_jobs/verifier.py), which itself
builds on the schema.

Object references of the form store:<key> (verifier.weights, prompts.source, evaluate's prompt sets) resolve
here, before validation, against the store the command uses: --store, else $EAGLE_JOBS_STORE, else the recipe's
store.uri. The resolved recipe holds full URIs, so its digests are those of a recipe that spelled them out.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe, StoreSpec, VerifierSpec, default_aux_layer_ids, error_location
from eagle_jobs.settings import settings
from eagle_jobs.store_refs import resolve_ref

# (section, key) pairs that may hold a store:<key> reference; evaluate.prompt_sets' values are resolved too
_REFS = (("verifier", "weights"), ("prompts", "source"))


def _aux_from_config(path: str | Path, raw: dict, verifier: VerifierSpec) -> dict:
    """A recipe that names neither aux_layer_ids nor verifier.num_layers gets its aux layers from the
    verifier's config (its layer count), read as every stage reads it (eagle_jobs/verifier.py)."""
    from eagle_jobs.verifier import num_layers  # transformers: only where a config must be read

    try:
        n = num_layers(verifier)
    except BadInput as e:
        raise BadInput(f"recipe {path}: aux_layer_ids is unset and {e}: set verifier.num_layers (the text "
                       "model's layer count) or aux_layer_ids") from None
    try:
        return {**raw, "aux_layer_ids": default_aux_layer_ids(n)}
    except ValueError as e:
        raise BadInput(f"recipe {path}: aux_layer_ids: {e}") from None


def load_recipe(path: str | Path, store: str | None = None) -> Recipe:
    """The recipe at `path`, its store:<key> references resolved against `store` (the command's --store)."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"recipe {path}: no such file (pass --recipe jobs/<name>.yaml)")
    return recipe_from_text(path.read_text(), path, store)


def store_of(raw: dict, store: str | None = None) -> str:
    """The store a command reading this recipe uses: --store, else $EAGLE_JOBS_STORE, else store.uri."""
    section = raw.get("store")
    stated = section.get("uri") if isinstance(section, dict) else None
    return store or settings().store or stated or StoreSpec.model_fields["uri"].default


def _refs_resolved(path: str | Path, raw: dict, store: str | None) -> dict:
    root = store_of(raw, store)

    def one(where: str, value: object) -> object:
        if not isinstance(value, str):
            return value  # the schema names a wrong type
        try:
            return resolve_ref(value, root)
        except BadInput as e:
            raise BadInput(f"recipe {path}: key '{where}': {e}") from None

    out = dict(raw)
    for section, key in _REFS:
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section] = {**out[section], key: one(f"{section}.{key}", out[section][key])}
    ev = out.get("evaluate")
    if isinstance(ev, dict):
        ev = dict(ev)
        if isinstance(ev.get("long_output"), dict) and "source" in ev["long_output"]:
            ev["long_output"] = {**ev["long_output"],
                                 "source": one("evaluate.long_output.source", ev["long_output"]["source"])}
        if isinstance(ev.get("prompt_sets"), dict):
            ev["prompt_sets"] = {name: one(f"evaluate.prompt_sets.{name}", v) for name, v in ev["prompt_sets"].items()}
        out["evaluate"] = ev
    return out


def recipe_from_text(text: str, path: str | Path = "<text>", store: str | None = None) -> Recipe:
    """A recipe from its YAML text (a file's, or a ConfigMap's), `path` naming it in errors, its store:<key>
    references resolved against `store` (else $EAGLE_JOBS_STORE, else its own store.uri)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"recipe {path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"recipe {path}: expected a mapping at the top level")
    raw = _refs_resolved(path, raw, store)
    if raw.get("aux_layer_ids") is None:
        # every other key is checked first: a wrong one is named before any config is read, downloaded or converted
        checked = _validated(path, {**raw, "aux_layer_ids": [1]})
        if checked.verifier.num_layers is None:
            raw = _aux_from_config(path, raw, checked.verifier)
    return _validated(path, raw)


def _validated(path: str | Path, raw: dict) -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key '{error_location(err)}' (check the spelling against docs/RECIPE.md)"
        elif not err["loc"] and err["type"] == "value_error":  # a whole-recipe check names its own keys
            msg = err["msg"].removeprefix("Value error, ")
        else:
            msg = f"key '{error_location(err)}': {err['msg']}"
        more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise BadInput(f"recipe {path}: {msg}{more}") from None
