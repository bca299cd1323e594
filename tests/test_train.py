"""capture -> extract -> train -> inspect on the tiny Kimi-shaped verifier, file:// and moto S3."""

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import draft_and_batch, draft_call_kwargs
from pipeline_helpers import _prepared

from eagle_jobs.capture import run_capture
from eagle_jobs.checkpoint_check import run_inspect
from eagle_jobs.committed import download_final
from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.extract import run_extract
from eagle_jobs.store import Stage, Store
from eagle_jobs.train.run import run_train

REPO = Path(__file__).resolve().parents[1]


def test_end_to_end_and_reload_with_speculators(tiny_recipe, store_uri, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel

    recipe = tiny_recipe()
    st = _prepared(recipe, store_uri)
    rec = run_train(recipe, st, "r", work_dir=tmp_path / "w")
    assert rec["samples"] == {"train": 13, "validation": 2} or sum(rec["samples"].values()) == 15
    assert rec["epochs"] == 2 and rec["scheduler"] == "cosine" and rec["total_steps"] == 2 * rec["steps_per_epoch"]
    assert 0 < rec["parameters"]["trainable"] < rec["parameters"]["total"]
    stage = Stage(st, "r", "train")
    assert stage.is_complete()
    assert [m["shard"] for m in stage.manifests()] == ["checkpoint-0000", "checkpoint-0001", "final"]
    # committed epochs leave the pod's disk (8 GiB each at the Kimi shape); the newest one stays
    local = [p.name for p in (tmp_path / "w").rglob("*") if p.is_dir() and p.name.isdigit() and not p.is_symlink()]
    assert local == ["1"]
    final = download_final(st, "r", tmp_path / "final")
    tc = json.loads((final / "train_config.json").read_text())
    assert tc["samples"]["validation"] == 2 and tc["parameters"] == rec["parameters"]
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["draft_vocab_size"] == 128
    assert cfg["transformer_layer_config"]["head_dim"] == 32 and cfg["norm_before_fc"] is True
    from safetensors import safe_open

    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        d2t = f.get_tensor("d2t")
        assert d2t.dtype == torch.int64 and d2t.shape == (128,)
    # the draft reloads with speculators' own from_pretrained
    config = Eagle3DraftModel.config_class.from_pretrained(str(final))
    config.transformer_layer_config._attn_implementation = "sdpa"
    m = Eagle3DraftModel.from_pretrained(str(final), config=config)
    assert m.fc.weight.shape == (64, 3 * 64) and torch.isfinite(m.fc.weight).all()
    attn = m.layers[0].self_attn  # 4 heads x 32 wide, reading [embedding; fused state] (2 x 64)
    assert attn.q_proj.weight.shape == (4 * 32, 2 * 64) and attn.o_proj.weight.shape == (64, 4 * 32)
    # and passes inspect
    assert run_inspect(str(final)) == ExitCode.OK
    assert run_inspect(st.url("r/train/data/final")) == ExitCode.OK


def test_bf16_states_into_fp32_master_draft(tiny_recipe, tmp_path, monkeypatch):
    """The seed's dtype crash: stored bf16 states must meet an fp32-master draft without a mismatch."""
    recipe = tiny_recipe(train={"epochs": 1})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    seen = {}
    from speculators.models.eagle3 import Eagle3DraftModel

    orig = Eagle3DraftModel.forward

    def spy(self, hidden_states, *a, **kw):
        seen["hs"], seen["param"] = hidden_states.dtype, self.fc.weight.dtype
        return orig(self, hidden_states, *a, **kw)

    monkeypatch.setattr(Eagle3DraftModel, "forward", spy)
    run_train(recipe, st, "r", work_dir=tmp_path / "w")
    assert seen["param"] == torch.float32 and seen["hs"] == torch.float32  # upcast on CPU, fp32 master
    (m,) = [m for m in Stage(st, "r", "extract").manifests()][:1]
    assert m["samples"][0]["tensors"]["hidden_states"]["dtype"] == "BF16"


def _assert_same_loss_and_metrics(ref, other, **tol):
    """Two draft forwards' (draft tokens, loss, metrics) agree in the loss and every tensor metric."""
    (_, loss_r, metrics_r), (_, loss_o, metrics_o) = ref, other
    torch.testing.assert_close(loss_o, loss_r, **tol)
    for k, v in metrics_r.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(metrics_o[k], v, msg=k, **tol)


def _assert_same_grads(ref_model, other_model, **tol):
    for (name, p_r), p_o in zip(ref_model.named_parameters(), other_model.parameters()):
        if p_r.grad is not None:
            torch.testing.assert_close(p_o.grad, p_r.grad, msg=name, **tol)


def test_flex_attention_draft_matches_sdpa(tiny_recipe):
    """On GPU the draft trains with flex attention; on CPU with sdpa. Through our layer config both must
    compute the same draft: same weights, two packed documents, the same loss and metrics.
    Forward only: flex has no CPU backward, and its block masks need T to be a multiple of 128."""
    (sdpa, flex), batch, kwargs = draft_and_batch(tiny_recipe(), "sdpa", "simple_flex_attention")
    assert flex.layers[0].self_attn.config._attn_implementation == "simple_flex_attention"
    with torch.no_grad():
        out_s, out_f = sdpa(**batch, **kwargs), flex(**batch, **kwargs)
    assert torch.isfinite(out_s[1]) and out_s[1] > 0
    _assert_same_loss_and_metrics(out_s, out_f, rtol=1e-4, atol=1e-5)


def test_compiled_draft_step_matches_eager(tiny_recipe):
    """On GPU speculators torch.compiles the draft's forward (conditional_torch_compile); on CPU it does
    not. Here the same forward goes through Dynamo and AOTAutograd (backend aot_eager: the tracing and
    the backward graph, without inductor's code generation, which the GPU check covers): loss and
    gradients equal eager's."""
    (eager, compiled), batch, kwargs = draft_and_batch(tiny_recipe(), "sdpa", "sdpa")
    torch._dynamo.reset()
    _, loss_e, _ = eager(**batch, **kwargs)
    _, loss_c, _ = torch.compile(compiled.forward, backend="aot_eager")(**batch, **kwargs)
    loss_e.backward()
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e)
    _assert_same_grads(eager, compiled)
    assert eager.fc.weight.grad.abs().sum() > 0


def test_fused_loss_matches_eager_in_the_draft(tiny_recipe, monkeypatch):
    """On GPU the draft trains with speculators' fused Triton loss; on CPU with the eager one. Triton's
    interpreter runs the same kernels on CPU tensors: inside the draft's forward (ttt steps, loss mask,
    draft-vocab targets) the fused loss gives eager's loss, metrics and gradients."""
    import importlib
    import sys

    if sys.platform != "linux":  # pyproject installs triton where it publishes wheels: Linux
        pytest.skip("triton has no wheels for this platform")
    assert os.environ["TRITON_INTERPRET"] == "1"  # conftest: triton reads it when first imported
    fused_mod = importlib.import_module("speculators.losses.fused")
    r = tiny_recipe()
    (eager, fused), batch, eager_kwargs = draft_and_batch(r, "sdpa", "sdpa")
    fused_kwargs = draft_call_kwargs(r, "fused")
    kernel = f"fused_{r.train.loss.name}_loss"
    calls = []
    real = getattr(fused_mod, kernel)
    monkeypatch.setattr(fused_mod, kernel, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out_e, out_f = eager(**batch, **eager_kwargs), fused(**batch, **fused_kwargs)
    out_e[1].backward()
    out_f[1].backward()
    assert len(calls) == r.train.ttt_steps  # one fused kernel launch per ttt step
    _assert_same_loss_and_metrics(out_e, out_f, rtol=1e-4, atol=1e-5)
    _assert_same_grads(eager, fused, rtol=1e-4, atol=1e-6)


def test_gpu_dtype_path_bf16_states_under_bf16_autocast(tiny_recipe):
    """On GPU, run_train feeds the stored bf16 states as they are and speculators' Trainer wraps the step
    in autocast(bf16) (hidden_states_dtype). CPU autocast has bf16 too: the same step on the fp32-master
    draft gives fp32 gradients and the fp32 path's loss to bf16 tolerance."""
    (draft,), batch, kwargs = draft_and_batch(tiny_recipe(), "sdpa")
    with torch.no_grad():
        _, loss_fp32, _ = draft(**batch, **kwargs)
    bf16 = {k: v.bfloat16() if k.endswith("hidden_states") else v for k, v in batch.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert draft.fc(bf16["hidden_states"]).dtype == torch.bfloat16  # the matmuls really run in bf16
        _, loss, _ = draft(**bf16, **kwargs)
    loss.backward()
    assert draft.fc.weight.dtype == draft.fc.weight.grad.dtype == torch.float32
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.grad is not None)
    torch.testing.assert_close(loss.float(), loss_fp32, rtol=2e-2, atol=2e-2)


def test_loss_decreases_on_its_training_data(tiny_recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EAGLE_JOBS_PROGRESS_INTERVAL_S", "0")
    recipe = tiny_recipe(train={"epochs": 8, "lr": 3e-3})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    rec = run_train(recipe, st, "r", work_dir=tmp_path / "w")
    losses = [m["train"]["loss_0"] for m in rec["metrics"] if "train" in m and "loss_0" in m["train"]]
    assert len(losses) >= 8 and sum(losses[-2:]) < 0.7 * sum(losses[:2])
    # off a terminal (a pod's log) speculators' rich bar is silent: our plain lines say where each epoch is
    err = capsys.readouterr().err
    assert re.search(r"train epoch 0: 1/\d+ steps \(\d+%\), elapsed 0:\d\d, ETA \d+:\d\d", err), err[-2000:]
    assert "train epoch 7: " in err
    # the curves, where people look for them: TensorBoard event files in the store beside the checkpoints
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "s" / "r" / "train" / "data" / "tensorboard").rglob("*tfevents*"))
    assert len(events) == 1 and events[0].parent.name.startswith("attempt-"), events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    loss = next(t for t in tags if t.endswith("loss_0"))
    assert [e.value for e in acc.Scalars(loss)] == pytest.approx(losses)
    assert any(t.startswith("val") and "full_acc_0" in t for t in tags), tags


def test_loader_workers_feed_the_same_batches(tiny_recipe, tmp_path):
    """train.num_workers > 0: speculators' DataLoader spawns workers, which import our dataset by name (a class
    local to a function cannot be pickled: it used to fail). Same seed, same batches: the same losses."""
    recipe = tiny_recipe(train={"epochs": 1})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    losses = {}
    for workers in (0, 1):
        r = recipe.model_copy(update={"train": recipe.train.model_copy(update={"num_workers": workers})})
        rec = run_train(r, st, "r", work_dir=tmp_path / f"w{workers}", variant=f"workers{workers}")
        losses[workers] = [m["train"]["loss_0"] for m in rec["metrics"] if "loss_0" in m.get("train", {})]
    assert len(losses[0]) >= 2 and losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_resume_after_sigterm_mid_training(tiny_recipe, tmp_path, monkeypatch):
    """A pod killed mid-training resumes from its last committed checkpoint, optimizer and scheduler included."""
    recipe = tiny_recipe(train={"epochs": 3, "total_seq_len": 64})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    from eagle_jobs import speculators_compat as compat

    orig = compat.StoreTrainer.train_epoch
    fired = {"n": 0}

    def killing_epoch(self, epoch, *, step_callback=None):
        def cb():
            fired["n"] += 1
            if step_callback:
                step_callback()
            if epoch == 1 and self._cur_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        return orig(self, epoch, step_callback=cb)

    monkeypatch.setattr(compat.StoreTrainer, "train_epoch", killing_epoch)
    with pytest.raises(EagleJobsError) as e:
        run_train(recipe, st, "r", work_dir=tmp_path / "w")
    assert e.value.code == ExitCode.INTERRUPTED
    stage = Stage(st, "r", "train")
    ckpts = {m["shard"]: m for m in stage.manifests()}
    assert set(ckpts) == {"checkpoint-0000", "checkpoint-0001-step-0000002"}  # a step checkpoint's name
    assert ckpts["checkpoint-0001-step-0000002"]["local_step"] == 2
    files = ckpts["checkpoint-0001-step-0000002"]["files"]
    assert "checkpoint-0001-step-0000002/optimizer_state_dict.state.safetensors" in files
    assert not any(f.endswith(".pt") for f in files)  # nothing pickled goes to the store
    monkeypatch.setattr(compat.StoreTrainer, "train_epoch", orig)
    loaded = {}
    real_load = compat.StoreTrainer.setup_optimizer  # ours: resumed at the global step (adaptation 11)

    def spy_opt(self):
        real_load(self)
        loaded["step"] = self.global_step
        loaded["lr"] = self.schedulers[0].last_epoch if self.schedulers else None
        loaded["state"] = len(self.optimizers[0].state)

    monkeypatch.setattr(compat.StoreTrainer, "setup_optimizer", spy_opt)
    rec = run_train(recipe, st, "r", work_dir=tmp_path / "w2")  # a fresh pod: empty local disk
    assert loaded["state"] > 0 and loaded["lr"] > 0  # optimizer moments and scheduler position restored
    assert loaded["step"] == rec["steps_per_epoch"] + 2  # resumed mid-epoch 1 at step 2
    assert stage.is_complete()
    # epoch 0 was validated before the kill: it still competes for final/
    assert sorted(rec["selection"]["per_epoch"]) == ["0", "1", "2"]


def test_the_epoch_with_the_best_held_out_tau_estimate_is_exported_not_the_lowest_loss():
    from eagle_jobs.train.checkpoints import select_epoch

    def val(epoch, *accs, loss):
        return {"val": {**{f"full_acc_{i}_epoch": a for i, a in enumerate(accs)}, "loss_epoch": loss}, "epoch": epoch}

    # the shape EAGLE-3 runs report: tau peaks at epoch 1 while the loss keeps falling
    records = [{"train": {"loss_0": 3.0}, "epoch": 0}, val(0, 0.5, 0.2, 0.1, loss=3.0),
               val(1, 0.7, 0.4, 0.2, loss=2.5), val(2, 0.6, 0.3, 0.1, loss=2.0), val(3, 0.7, 0.4, 0.2, loss=1.9)]
    sel = select_epoch(records, 3, last=3)
    assert sel["epoch"] == 1 and sel["tau_estimate"] == pytest.approx(2.3)  # the earliest of equals
    assert sel["per_epoch"]["2"] == pytest.approx(2.0) and "not the lowest loss" in sel["by"]
    assert select_epoch(records, 1, last=3)["epoch"] == 1
    assert select_epoch([{"train": {}, "epoch": 0}], 3, last=4) == {
        "epoch": 4, "by": "the last epoch: no held-out samples to measure on", "per_epoch": {}}


def test_final_is_the_selected_epochs_checkpoint_fetched_back_from_the_store(tiny_recipe, tmp_path, monkeypatch):
    """Local epochs are pruned once committed; an earlier best epoch comes back from the store for export."""
    from safetensors.torch import load as load_st

    from eagle_jobs.train import checkpoints

    recipe = tiny_recipe(train={"epochs": 3})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    chosen = {}

    def first_epoch(records, k, last):
        chosen["real"] = real(records, k, last)
        return {**chosen["real"], "epoch": 0, "tau_estimate": chosen["real"]["per_epoch"]["0"]}

    real = checkpoints.select_epoch
    monkeypatch.setattr(checkpoints, "select_epoch", first_epoch)
    rec = run_train(recipe, st, "r", work_dir=tmp_path / "w")
    assert sorted(chosen["real"]["per_epoch"]) == ["0", "1", "2"] and rec["selection"]["epoch"] == 0
    stage = Stage(st, "r", "train")
    final, ckpt0, ckpt2 = (stage.manifest(n) for n in ("final", "checkpoint-0000", "checkpoint-0002"))
    assert final["epoch"] == 0
    weights = load_st(stage.read("final/model.safetensors", final["files"]["final/model.safetensors"]))
    w0 = load_st(stage.read("checkpoint-0000/model.safetensors", ckpt0["files"]["checkpoint-0000/model.safetensors"]))
    w2 = load_st(stage.read("checkpoint-0002/model.safetensors", ckpt2["files"]["checkpoint-0002/model.safetensors"]))
    name = next(k for k in weights if "fc" in k)
    assert torch.equal(weights[name].float(), w0[name].float()) and not torch.equal(w0[name], w2[name])
    cfg = json.loads(stage.read("final/train_config.json", final["files"]["final/train_config.json"]))
    assert cfg["selection"]["epoch"] == 0 and cfg["selection"]["last_epoch"] == 2


def test_train_refuses_draft_with_other_aux_ids(tiny_recipe, tmp_path):
    st = _prepared(tiny_recipe(), f"file://{tmp_path}/s")
    with pytest.raises(BadInput, match=r"stored aux layers \[1, 2, 3\].*wants \[1, 2\]"):
        run_train(tiny_recipe(aux_layer_ids=[1, 2]), st, "r", work_dir=tmp_path / "w")


@pytest.mark.parametrize("draft,msg", [
    ({"hidden_size": 128}, "!= verifier hidden size 64"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "not divisible"),
    ({"draft_vocab_size": 100000}, "> verifier vocab"),
])
def test_impossible_draft_shapes_rejected_with_numbers(tiny_recipe, tmp_path, draft, msg):
    st = _prepared(tiny_recipe(), f"file://{tmp_path}/s")
    with pytest.raises(BadInput, match=msg):
        run_train(tiny_recipe(draft=draft), st, "r", work_dir=tmp_path / "w")


def test_derived_shape_is_printed(tiny_recipe, capsys):
    from eagle_jobs.draft import resolve_shape
    from eagle_jobs.verifier import load_config, text_config

    r = tiny_recipe(draft={"num_attention_heads": None, "num_key_value_heads": None, "head_dim": None,
                           "intermediate_size": None})
    shape = resolve_shape(r, text_config(load_config(r.verifier)))
    assert (shape.num_attention_heads, shape.head_dim) == (4, 16)
    assert "derived" in shape.describe() and "head_dim" in shape.describe()


def test_kimi_recipe_shape_is_the_reference(tmp_path):
    """The Kimi recipes pin 64 heads x head_dim 128 on hidden 7168 (not the derived 112)."""
    from types import SimpleNamespace

    from eagle_jobs.draft import resolve_shape
    from eagle_jobs.recipe_file import load_recipe

    kimi_text = SimpleNamespace(num_hidden_layers=61, hidden_size=7168, vocab_size=163840, num_attention_heads=64,
                                num_key_value_heads=64, intermediate_size=18432, kv_lora_rank=512)
    s = resolve_shape(load_recipe(REPO / "jobs/kimi-k2.5-smoke.yaml"), kimi_text)
    assert (s.hidden_size, s.num_attention_heads, s.head_dim, s.draft_vocab_size) == (7168, 64, 128, 32000)
    assert s.derived == ()


def test_cli_inspect_exit_codes(tiny_recipe, tmp_path):
    import subprocess
    import sys

    st = _prepared(tiny_recipe(train={"epochs": 1}), f"file://{tmp_path}/s")
    run_train(tiny_recipe(train={"epochs": 1}), st, "r", work_dir=tmp_path / "w")
    final = download_final(st, "r", tmp_path / "final")
    ok = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "inspect", str(final)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "inspect", str(final), "--reference",
                          str(REPO / "jobs/reference/kimi-k2.5-eagle3.json")], capture_output=True, text=True)
    assert bad.returncode == int(ExitCode.INCOMPATIBLE) and "head_dim" in bad.stdout + bad.stderr
    # a checkpoint with midlayer.* keys (SGLang/AQ-MedAI naming) loads in vLLM too
    from safetensors.torch import load_file, save_file

    sd = load_file(str(final / "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer.", 1): v for k, v in sd.items()}, str(final / "model.safetensors"))
    assert run_inspect(str(final)) == ExitCode.OK
    sd.pop("fc.weight")
    save_file(sd, str(final / "model.safetensors"))
    assert run_inspect(str(final)) == ExitCode.INCOMPATIBLE


def test_draft_config_tells_vllm_its_aux_count(tiny_recipe, tmp_path, capsys):
    """vLLM sizes a served EAGLE-3 fc for 3 aux states unless the config says otherwise
    (llama_eagle3.py): a 2-aux draft must carry num_aux_hidden_states, and inspect checks vLLM's value."""
    import json

    from eagle_jobs.checkpoint_check import vllm_num_aux_hidden_states

    recipe = tiny_recipe(aux_layer_ids=[1, 3], train={"epochs": 1})
    st = Store.open(f"file://{tmp_path}/s")
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    run_train(recipe, st, "r")
    final = download_final(st, "r", tmp_path / "final")
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_aux_hidden_states"] == 2
    assert vllm_num_aux_hidden_states(cfg) == 2
    assert run_inspect(str(final)) == ExitCode.OK
    del cfg["transformer_layer_config"]["num_aux_hidden_states"]
    (final / "config.json").write_text(json.dumps(cfg))
    assert vllm_num_aux_hidden_states(cfg) == 3
    capsys.readouterr()
    assert run_inspect(str(final)) == ExitCode.INCOMPATIBLE
    assert "vLLM would size fc for 3 aux states" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_on_cpu(tiny_recipe, tmp_path, fsdp):
    """nproc_per_node 2: torchrun ranks (gloo on CPU) train one DDP/FSDP model and split the batches."""
    from safetensors.torch import load

    recipe = tiny_recipe(train={"nproc_per_node": 2, "total_seq_len": 64, "fsdp": fsdp})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    rec = run_train(recipe, st, "r", work_dir=tmp_path / "w")
    single = tiny_recipe(train={"total_seq_len": 64})
    one = run_train(single, _prepared(single, st.uri, "one"), "one", work_dir=tmp_path / "w1")
    assert (rec["world_size"], one["world_size"]) == (2, 1)
    assert rec["steps_per_epoch"] < one["steps_per_epoch"]  # the distributed sampler split the batches
    stage = Stage(st, "r", "train")
    assert stage.is_complete()
    assert [m["shard"] for m in stage.manifests()] == ["checkpoint-0000", "checkpoint-0001", "final"]
    m = stage.manifest("final")
    sd = load(stage.read("final/model.safetensors", m["files"]["final/model.safetensors"]))
    assert sd["fc.weight"].dtype == torch.bfloat16 and torch.isfinite(sd["fc.weight"].float()).all()


# `eagle-jobs train` as the pod runs it, noting at exit whether that process (not its ranks) imported speculators
POD_MAIN = """
import atexit, runpy, sys
note = sys.argv.pop(1)
atexit.register(lambda: open(note, "w").write(str("speculators" in sys.modules)))
sys.argv[0] = "eagle-jobs"
runpy.run_module("eagle_jobs.cli", run_name="__main__")
"""


def _train_cli(recipe, st, tmp_path, **popen):
    import subprocess
    import sys

    rfile = tmp_path / "recipe.yaml"
    rfile.write_text(json.dumps(recipe.model_dump(mode="json")))
    env = {**os.environ, "EAGLE_JOBS_WORK_DIR": str(tmp_path / "w-cli")}
    return subprocess.Popen([sys.executable, "-c", POD_MAIN, str(tmp_path / "pod-imported-speculators"), "train",
                             "--recipe", str(rfile), "--store", st.uri, "--run-id", "r"], env=env, **popen)


def test_rank_failure_exit_code_reaches_the_pod(tiny_recipe, tmp_path):
    """torchrun says 1 for any failed rank; the pod must still exit with the rank's documented code. The
    pod's own process only launches the ranks: it never imports speculators (about 8 s, paid by each rank)."""
    import subprocess

    recipe = tiny_recipe(train={"nproc_per_node": 2, "attention": "simple_flex_attention"})
    st = _prepared(recipe, f"file://{tmp_path}/s")
    proc = _train_cli(recipe, st, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == ExitCode.BAD_INPUT, out[-3000:]
    assert "train.attention simple_flex_attention needs a GPU" in out
    assert (tmp_path / "pod-imported-speculators").read_text() == "False"
