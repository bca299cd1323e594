"""The recipe as people read it: the reference of every setting (docs/RECIPE.md, generated from the schema's
`Field(description=...)`), and one recipe resolved, with the values derived from its verifier (`recipe show`).
"""

from __future__ import annotations

import json
import types
import typing
from typing import Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from eagle_jobs.recipe import Recipe

REFERENCE_PATH = "docs/RECIPE.md"
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "at least"))


def _model_of(annotation) -> type[BaseModel] | None:
    """The section a field holds (X or X | None), else None."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _section(field: FieldInfo) -> type[BaseModel] | None:
    """The section a field holds itself (not a mapping of them)."""
    return None if typing.get_origin(field.annotation) is dict else _model_of(field.annotation)


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    derived = (field.json_schema_extra or {}).get("derived") if isinstance(field.json_schema_extra, dict) else None
    if derived:
        return f"derived: {derived}"
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    if _section(field) is not None and field.default is not None:
        return "its defaults"
    value = field.get_default(call_default_factory=True)
    return f"`{json.dumps(value)}`"


def _bounds(field: FieldInfo) -> str:
    found = [f"{word} {getattr(m, attr)}" for m in field.metadata for attr, word in _BOUNDS if hasattr(m, attr)]
    return ", ".join(found)


def _sections(model: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, model) of `model` and of every section under it, in declaration order."""
    found = [(path, model)]
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:  # a mapping of sections: one entry's keys, under <name>
            key = name if _section(field) is not None else f"{name}.<name>"
            found += _sections(sub, f"{path}.{key}" if path else key)
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """docs/RECIPE.md: every key of a recipe with its type, default, bounds and meaning."""
    out = ["# Recipe reference", "",
           "Generated from the schema (src/eagle_jobs/recipe/) by `eagle-jobs recipe reference`; "
           "tests/test_recipe_reference.py keeps the two equal. A recipe states only what differs from these "
           "defaults: `eagle-jobs recipe show --recipe jobs/<name>.yaml` prints one resolved, with the values "
           "derived from its verifier, and `eagle-jobs recipe check` checks one without starting anything.", ""]
    for path, model in _sections(Recipe, ""):
        title = f"`{path}`" if path else "The top level"
        doc = " ".join((model.__doc__ or "").split())
        out += [f"## {title}", "", doc, "", "| key | type | default | bounds | meaning |",
                "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            meaning = field.description or ""
            if _model_of(field.annotation) is not None:
                key = name if _section(field) is not None else f"{name}.<name>"
                meaning += f" (section `{f'{path}.{key}' if path else key}` below)"
            out.append(f"| `{name}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} | "
                       f"{_bounds(field)} | {_cell(meaning)} |")
        out.append("")
    return "\n".join(out)


def undescribed_settings() -> list[str]:
    """Every setting without a description: the reference would say nothing of it."""
    return [f"{path}.{name}".lstrip(".") for path, model in _sections(Recipe, "")
            for name, field in model.model_fields.items() if not field.description]


def resolved_yaml(recipe: Recipe) -> str:
    """The recipe with every default filled in, as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, width=110)


def draft_shape(recipe: Recipe):
    """The draft's shape on this verifier, from its config where it can be read, else the recipe's numbers
    (as `plan` resolves it); out-of-range aux layers and a shape that cannot sit on the verifier are refused."""
    from eagle_jobs.draft import resolve_shape
    from eagle_jobs.plan import verifier_text_config

    return resolve_shape(recipe, verifier_text_config(recipe))


def check_line(recipe: Recipe, stated: dict) -> str:
    aux = "derived" if stated.get("aux_layer_ids") is None else "stated"
    return (f"recipe {recipe.name}: sound; aux_layer_ids {recipe.aux_layer_ids} ({aux}); "
            f"draft {draft_shape(recipe).describe()}")


def show_text(recipe: Recipe, stated: dict) -> str:
    """`recipe show`: the resolved recipe as YAML, then what is derived from the verifier and the plan's summary
    as comments (the plan needs the prompts; where they cannot be read here, it says why)."""
    from eagle_jobs.errors import EagleJobsError
    from eagle_jobs.plan import duration_text, make_plan

    lines = [resolved_yaml(recipe).rstrip(), "", "# derived", f"# {check_line(recipe, stated)}"]
    try:
        p = make_plan(recipe)
    except EagleJobsError as e:
        return "\n".join([*lines, f"# plan: not here ({e})"])
    lines.append(f"# storage dtype {p['storage']} ({p['stored_layers']} layers stored); "
                 f"{p['conversations']:,} conversations, ~{p['tokens']:,} tokens")
    for name, st in p["stages"].items():
        lines.append(f"# {name}: ~{duration_text(st['time_s'])} at the `plan:` rates, deadline >= "
                     f"{st['deadline_floor_s']:,} s")
    return "\n".join(lines)
