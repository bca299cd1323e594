"""The recipe reference equals the schema, the defaults are the measured good ones, and the recipes in jobs/
state only what differs from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from eagle_jobs import recipe as recipe_mod
from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe, default_aux_layer_ids, sections
from eagle_jobs.recipe_file import load_recipe
from eagle_jobs.recipe_view import REFERENCE_PATH, reference_markdown, undescribed_settings

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "eagle_jobs.cli"]


def test_the_reference_is_the_schema():
    assert undescribed_settings() == []
    doc = (ROOT / REFERENCE_PATH).read_text()
    assert doc == reference_markdown(), f"run `eagle-jobs recipe reference --out {REFERENCE_PATH}`"
    for key in ("`aux_layer_ids`", "`num_speculative_tokens`", "`window_bytes`", "`fc_norm`"):
        assert key in doc


def test_the_reference_command_prints_the_document():
    out = subprocess.run([*CLI, "recipe", "reference"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout == (ROOT / REFERENCE_PATH).read_text()


def test_aux_layers_derive_by_the_rule_speculators_applies(tmp_path):
    from speculators.models.utils import resolve_target_layer_ids
    from transformers import LlamaConfig

    for n in (12, 36, 61):
        LlamaConfig(num_hidden_layers=n, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    vocab_size=256).save_pretrained(tmp_path / str(n))
        assert default_aux_layer_ids(n) == resolve_target_layer_ids(None, str(tmp_path / str(n)))
    assert default_aux_layer_ids(4) == [1, 2]  # in range and ascending on a very small verifier
    with pytest.raises(ValueError, match="no layer"):
        default_aux_layer_ids(1)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_aux_layers_come_from_num_layers_or_the_verifier_config(tmp_path):
    stated = _write(tmp_path, "name: x\nverifier: {model: org/m, num_layers: 36}\nprompts: {source: p.jsonl}\n")
    assert load_recipe(stated).aux_layer_ids == [2, 18, 33]
    gguf = _write(tmp_path, f"name: x\nverifier: {{model: '{recipe_mod.EMBEDDED_SMOLLM2}'}}\n"
                            "prompts: {source: p.jsonl}\n")
    assert load_recipe(gguf).aux_layer_ids == [2, 15, 27]  # SmolLM2-135M: 30 layers, read from the GGUF


def test_a_recipe_without_aux_layers_and_no_readable_config_is_refused_in_one_line(tmp_path):
    local = tmp_path / "no-model-here"
    local.mkdir()
    path = _write(tmp_path, f"name: x\nverifier: {{model: '{local}'}}\nprompts: {{source: p.jsonl}}\n")
    r = subprocess.run([*CLI, "recipe", "check", "--recipe", str(path)], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "aux_layer_ids is unset" in line and "verifier.num_layers" in line


def test_a_wrong_key_is_named_before_any_config_is_read(tmp_path):
    """The config read (a download, a GGUF conversion) comes after the rest of the recipe is checked."""
    local = tmp_path / "no-model-here"
    local.mkdir()
    path = _write(tmp_path, f"name: x\nverifier: {{model: '{local}'}}\nprompts: {{source: p.jsonl}}\n"
                            "train: {optimiser: adamw}\n")
    with pytest.raises(BadInput, match="unknown key 'train.optimiser'"):
        load_recipe(path)


def test_num_layers_in_any_form_the_schema_takes_derives_the_aux_layers(tmp_path):
    path = _write(tmp_path, "name: x\nverifier: {model: org/m, num_layers: '36'}\nprompts: {source: p.jsonl}\n")
    assert load_recipe(path).aux_layer_ids == [2, 18, 33]


def test_backends_default_to_vllm_where_it_is_installed(monkeypatch):
    base = {"name": "x", "verifier": {"model": "org/m", "num_layers": 8}, "prompts": {"source": "p.jsonl"}}
    monkeypatch.delenv("EAGLE_JOBS_VLLM_ENDPOINT", raising=False)
    monkeypatch.setattr(sections, "vllm_installed", lambda: True)
    r = Recipe.model_validate(base)
    assert (r.capture.backend, r.extract.backend, r.evaluate.backend) == ("vllm",) * 3
    monkeypatch.setattr(sections, "vllm_installed", lambda: False)
    r = Recipe.model_validate(base)
    assert (r.capture.backend, r.extract.backend, r.evaluate.backend) == ("transformers",) * 3
    # a worker beside the pod's vLLM sidecar reaches vLLM without having it installed
    monkeypatch.setenv("EAGLE_JOBS_VLLM_ENDPOINT", "http://127.0.0.1:8000")
    assert Recipe.model_validate(base).capture.backend == "vllm"
    stated = {**base, "capture": {"backend": "transformers"}}
    assert Recipe.model_validate(stated).capture.backend == "transformers"


def test_training_defaults_are_the_comparisons_choice():
    t = Recipe.model_validate({"name": "x", "verifier": {"model": "org/m", "num_layers": 8},
                               "prompts": {"source": "p.jsonl"}}).train
    assert (t.optimizer, t.lr) == ("muon", 1e-3)


def stated_defaults(raw: dict, model: type[BaseModel], prefix: str = "") -> list[str]:
    """Keys a recipe states with the value the schema would give it anyway."""
    found = []
    for key, value in raw.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        sub = field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) \
            else None
        if sub is not None and isinstance(value, dict):
            found += stated_defaults(value, sub, f"{prefix}{key}.")
            continue
        if field.default is PydanticUndefined and field.default_factory is None:
            continue
        default = field.get_default(call_default_factory=True)
        if value == default or (isinstance(default, list) and len(default) == 1 and value == default[0]):
            found.append(prefix + key)
    return found


# Stated on purpose: a machine without vLLM (a laptop's `plan`, the train image) would resolve transformers,
# and price or read the cluster's run as another.
STATED_ON_PURPOSE = {"capture.backend", "extract.backend", "evaluate.backend"}


@pytest.mark.parametrize("path", sorted((ROOT / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_recipes_state_only_what_differs_from_the_defaults(path):
    raw = yaml.safe_load(path.read_text())
    assert [k for k in stated_defaults(raw, Recipe) if k not in STATED_ON_PURPOSE] == []
    if (raw.get("verifier") or {}).get("num_layers"):
        assert "aux_layer_ids" not in raw or raw["aux_layer_ids"] != default_aux_layer_ids(
            raw["verifier"]["num_layers"])


def test_the_checker_finds_a_stated_default():
    raw = {"train": {"optimizer": "muon", "lr": 1e-4}, "evaluate": {"num_speculative_tokens": 3}}
    assert stated_defaults(raw, Recipe) == ["train.optimizer", "evaluate.num_speculative_tokens"]


def test_recipe_show_prints_a_recipe_that_runs_the_same(tmp_path):
    src = ROOT / "jobs" / "kimi-k2.5.yaml"
    out = subprocess.run([*CLI, "recipe", "show", "--recipe", str(src)], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert "aux_layer_ids [2, 30, 58] (derived)" in out and "head_dim=128" in out and "storage dtype fp8" in out
    shown = _write(tmp_path, out)
    assert load_recipe(shown).digest() == load_recipe(src).digest()


def test_recipe_check_names_the_key_of_a_bad_recipe(tmp_path):
    ok = subprocess.run([*CLI, "recipe", "check", "--recipe", str(ROOT / "jobs" / "demo.yaml")],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "aux_layer_ids [2, 15, 27] (derived)" in ok.stdout and "head_dim=64" in ok.stdout
    bad = _write(tmp_path, (ROOT / "jobs" / "demo.yaml").read_text() + "aux_layer_ids: [2, 15, 30]\n")
    r = subprocess.run([*CLI, "recipe", "check", "--recipe", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 3 and "aux_layer_ids [2, 15, 30]: [30] out of range" in r.stderr.strip().splitlines()[-1]
