"""A recipe file as every command reads it: YAML, checked by the schema (eagle_jobs/recipe.py), with the values
the schema derives from the verifier's config filled in.

Apart from the schema because the derivation reads the verifier's config (eagle_jobs/verifier.py), which itself
builds on the schema.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe, VerifierSpec, default_aux_layer_ids, error_location


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


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"recipe {path}: no such file (pass --recipe jobs/<name>.yaml)")
    return recipe_from_text(path.read_text(), path)


def recipe_from_text(text: str, path: str | Path = "<text>") -> Recipe:
    """A recipe from its YAML text (a file's, or a ConfigMap's), `path` naming it in errors."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"recipe {path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"recipe {path}: expected a mapping at the top level")
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
