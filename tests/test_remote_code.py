"""A verifier repository's own code runs only in the vLLM server, never in an eagle-jobs process: those hold
the store's read-write key (prepare, the workers, train). The trap is a copy of the tiny Kimi verifier whose
config.json and tokenizer_config.json name Python files of the repository in `auto_map`, as Kimi-K2.5's do;
importing any of them writes a marker. transformers itself imports them when asked to trust the repository
(the first test), so the marker is seen when it happens."""

import json
import shutil

import pytest

from eagle_jobs.errors import BadInput
from eagle_jobs.recipe import Recipe, VerifierSpec

TRAP = '''import os
with open(os.environ["EAGLE_JOBS_TEST_TRAP"], "a") as f:
    f.write(__name__ + "\\n")
raise ImportError("the verifier repository's code ran")
'''


@pytest.fixture
def trapped(tmp_path, tiny_kimi, monkeypatch):
    """(the trapped verifier's directory, the marker file)."""
    d = tmp_path / "trapped-kimi"
    shutil.copytree(tiny_kimi, d, ignore=shutil.ignore_patterns("model.safetensors"))
    (d / "model.safetensors").symlink_to(tiny_kimi / "model.safetensors")
    for name in ("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py"):
        (d / name).write_text(TRAP)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",  # moonshotai/Kimi-K2.5's config.json
                       "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                       "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}
    (d / "config.json").write_text(json.dumps(cfg))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    marker = tmp_path / "ran"
    monkeypatch.setenv("EAGLE_JOBS_TEST_TRAP", str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    return d, marker


def test_the_trap_springs_when_transformers_trusts_the_repository(trapped):
    from transformers import AutoConfig, AutoTokenizer

    d, marker = trapped
    with pytest.raises(ImportError):
        AutoConfig.from_pretrained(d, trust_remote_code=True)
    assert "configuration_kimi_k25" in marker.read_text()
    cfg = json.loads((d / "config.json").read_text())
    del cfg["auto_map"]  # AutoTokenizer reads the config first: the tokenizer's own trap, alone
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ImportError):
        AutoTokenizer.from_pretrained(d, trust_remote_code=True)
    assert "tokenization_kimi" in marker.read_text()


def test_config_tokenizer_and_model_load_without_the_repositorys_code(trapped):
    from transformers.models.deepseek_v3 import DeepseekV3Config
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    from eagle_jobs.verifier import load_config, load_tokenizer, load_verifier_uncached, num_layers

    d, marker = trapped
    spec = VerifierSpec(model=str(d), trust_remote_code=True)
    cfg = load_config(spec)
    assert isinstance(cfg, Kimi_K25Config) and isinstance(cfg.text_config, DeepseekV3Config)
    assert num_layers(spec) == 4 and cfg.architectures == ["KimiK25ForConditionalGeneration"]
    tok = load_tokenizer(spec)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert load_verifier_uncached(spec).num_layers == 4
    assert not marker.exists()


def test_a_config_transformers_does_not_know_is_read_as_its_fields(tmp_path):
    from eagle_jobs.verifier import config_from_dict, text_config

    cfg = config_from_dict({"model_type": "acme_vl", "architectures": ["AcmeForCausalLM"],
                            "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"},
                            "text_config": {"model_type": "llama", "num_hidden_layers": 7, "hidden_size": 64,
                                            "num_attention_heads": 4}})
    assert cfg.architectures == ["AcmeForCausalLM"] and not hasattr(cfg, "auto_map")
    assert type(text_config(cfg)).__name__ == "LlamaConfig" and text_config(cfg).num_hidden_layers == 7
    plain = config_from_dict({"model_type": "acme", "num_hidden_layers": 5})
    assert plain.num_hidden_layers == 5


def test_a_tokenizer_only_the_repositorys_code_can_load_is_one_line_naming_the_vllm_backend(trapped):
    from eagle_jobs.verifier import load_tokenizer

    d, marker = trapped
    (d / "tokenizer.json").unlink()
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "TikTokenTokenizer"  # Kimi-K2.5's: a class only its repository defines
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(BadInput, match="only in the vLLM server: use the vllm backend"):
        load_tokenizer(VerifierSpec(model=str(d), trust_remote_code=True))
    assert not marker.exists()


def test_the_whole_transformers_pipeline_never_runs_the_repositorys_code(trapped, tiny_recipe, tmp_path):
    """capture, extract, train (speculators reads the verifier's config too) and evaluate, with
    verifier.trust_remote_code true, as the Kimi recipes set it."""
    from eagle_jobs.capture import run_capture
    from eagle_jobs.evaluate.run import run_evaluate
    from eagle_jobs.extract import run_extract
    from eagle_jobs.store import Store
    from eagle_jobs.train.run import run_train

    d, marker = trapped
    recipe = tiny_recipe(verifier={"model": str(d), "trust_remote_code": True}, train={"epochs": 1})
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "t")
    run_extract(recipe, st, "t")
    run_train(recipe, st, "t", work_dir=tmp_path / "w")
    report = run_evaluate(recipe, st, "t")
    assert report["acceptance_length"] >= 1.0
    assert not marker.exists()


def test_serve_args_with_remote_code_need_the_pinned_flag(tiny_recipe):
    with pytest.raises(ValueError, match="capture.vllm.serve_args has --trust-remote-code: set verifier"):
        tiny_recipe(capture={"backend": "vllm", "vllm": {"serve_args": ["--trust-remote-code"]}})
    r = tiny_recipe(verifier={"model": "x", "trust_remote_code": True},
                    capture={"vllm": {"serve_args": ["--trust-remote-code"]}})
    assert isinstance(r, Recipe)
