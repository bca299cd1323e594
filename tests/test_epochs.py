"""Choosing the epoch by served tau: `eagle-jobs rank-epochs` and train.select_by: served.

The unit tests hold Spearman's rho to hand-computed values (ties included). The train-tier tests run
the chain on the tiny Kimi-shaped verifier with the transformers backends (the served loop in process):
select_by served exports the best-served epoch through `eagle-jobs run` and `compare`, a rewrite of
final/ cut short is redone, and nothing committed is served again. The vllm-tier test serves each epoch
of a SmolLM2 draft with real vLLM and checks each served tau against the transformers loop on that
epoch's own checkpoint (equal in fp32: tests/test_vllm_real.py).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port, write_prompts

from eagle_jobs import epochs
from eagle_jobs.epochs import average_ranks, rank_epochs, select_served, spearman
from eagle_jobs.errors import BadInput, StoreError
from eagle_jobs.recipe import EMBEDDED_SMOLLM2, Recipe
from eagle_jobs.store import Stage, Store
from eagle_jobs.train import checkpoints
from eagle_jobs.train.run import run_train


# -- Spearman's rho -------------------------------------------------------------------------------
def test_average_ranks_share_the_mean_rank_of_a_tie():
    assert average_ranks([10.0, 30.0, 20.0]) == [1.0, 3.0, 2.0]
    assert average_ranks([1.0, 2.0, 2.0, 3.0]) == [1.0, 2.5, 2.5, 4.0]
    assert average_ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]


def test_spearman_without_ties_is_the_textbook_value():
    # Wikipedia's "Spearman's rank correlation coefficient" worked example (IQ against hours of TV a week):
    # sum d^2 = 194 over n = 10, rho = 1 - 6 * 194 / (10 * 99) = -29/165
    iq = [106, 100, 86, 101, 99, 103, 97, 113, 112, 110]
    tv = [7, 27, 2, 50, 28, 29, 20, 12, 6, 17]
    assert spearman(iq, tv) == pytest.approx(-29 / 165, abs=1e-12)
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_spearman_with_ties_is_pearson_on_average_ranks():
    # ranks x = 1, 2.5, 2.5, 4 and y = 1, 3, 2, 4: sxy = 4.5, sxx = 4.5, syy = 5, rho = 3 / sqrt(10);
    # the no-ties shortcut 1 - 6 sum d^2 / (n (n^2 - 1)) would say 0.95 here
    assert spearman([1.0, 2.0, 2.0, 3.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(3 / math.sqrt(10), abs=1e-12)
    # two epochs whose served tau ties: ranks 1, 2, 3 against 1, 2.5, 2.5, rho = 1.5 / sqrt(2 * 1.5)
    assert spearman([1.2, 1.3, 1.4], [1.4, 1.5, 1.5]) == pytest.approx(math.sqrt(3) / 2, abs=1e-12)
    # a tie that cancels out: ranks 1, 3, 2 against 2.5, 2.5, 1 have no linear relation
    assert spearman([1.2, 1.4, 1.3], [1.5, 1.5, 1.4]) == pytest.approx(0.0, abs=1e-12)


def test_spearman_is_undefined_on_a_constant_side_or_one_pair():
    assert spearman([1.0, 2.0, 3.0], [1.5, 1.5, 1.5]) is None
    assert spearman([1.0], [2.0]) is None and spearman([], []) is None
    with pytest.raises(ValueError, match="3 values against 2"):
        spearman([1, 2, 3], [1, 2])


def test_the_best_served_epoch_breaks_ties_by_the_estimate_then_the_earliest():
    rows = [{"epoch": 0, "served_tau": 1.5, "teacher_forced_estimate": 1.2},
            {"epoch": 1, "served_tau": 1.5, "teacher_forced_estimate": 1.4},
            {"epoch": 2, "served_tau": 1.5, "teacher_forced_estimate": 1.4},
            {"epoch": 3, "served_tau": 1.3, "teacher_forced_estimate": 1.9}]
    assert epochs.best_served(rows) == 1
    assert epochs.best_served([{**r, "teacher_forced_estimate": None} for r in rows]) == 0


# -- select_by served on the tiny verifier (transformers backends) -------------------------------------
def _served_counter(monkeypatch) -> list[int]:
    served: list[int] = []
    real = epochs.serve_epoch

    def counting(recipe, train, ckpt, prompts):
        served.append(ckpt["epoch"])
        return real(recipe, train, ckpt, prompts)

    monkeypatch.setattr(epochs, "serve_epoch", counting)
    return served


def _final(st: Store, train_dir: str = "train") -> tuple[dict, dict]:
    stage = Stage(st, "r", train_dir)
    m = stage.manifest("final")
    return m, json.loads(stage.read("final/train_config.json", m["files"]["final/train_config.json"]))


def _report(st: Store, where: str = "epochs") -> dict:
    stage = Stage(st, "r", where)
    return json.loads(stage.read("report.json", stage.manifest("report")["files"]["report.json"]))


@pytest.mark.train
def test_select_by_served_exports_the_best_served_epoch_and_serves_nothing_twice(tiny_recipe, tmp_path, monkeypatch):
    from eagle_jobs.capture import run_capture
    from eagle_jobs.extract import run_extract
    from eagle_jobs.pipeline import run_pipeline

    monkeypatch.setenv("EAGLE_JOBS_WORK_DIR", str(tmp_path / "work"))
    recipe = tiny_recipe(train={"epochs": 3, "select_by": "served"})
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    # the train stage alone exports the estimate's choice; here made epoch 0 (as test_train's export test
    # does), so that a re-export of another epoch shows whatever the two rankings say on this tiny run
    real_select = checkpoints.select_epoch
    monkeypatch.setattr(checkpoints, "select_epoch",
                        lambda records, k, last: {**real_select(records, k, last), "epoch": 0})
    run_train(recipe, st, "r")
    monkeypatch.setattr(checkpoints, "select_epoch", real_select)
    old, old_cfg = _final(st)
    assert "selected_by" not in old and old["epoch"] == old_cfg["selection"]["epoch"] == 0
    served = _served_counter(monkeypatch)

    # a rewrite of final/ cut short: the new objects are written, the new manifest is not
    real_put_json = Store.put_json

    def dies_at_the_manifest(self, key, obj):
        if key.endswith("train/manifests/final.json"):
            raise KeyboardInterrupt("killed before the manifest")
        return real_put_json(self, key, obj)

    monkeypatch.setattr(Store, "put_json", dies_at_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        select_served(recipe, st, "r")
    monkeypatch.setattr(Store, "put_json", real_put_json)
    assert served == [0, 1, 2] and Stage(st, "r", "train").manifest("final") == old
    with pytest.raises(StoreError, match="sha256 mismatch"):  # final/ is broken until the rewrite is redone
        Stage(st, "r", "train").read("final/train_config.json", old["files"]["final/train_config.json"])

    # `eagle-jobs run`: every stage committed; the selection is redone from the kept record, serving nothing
    out = run_pipeline(recipe, st, "r", stages=["capture", "extract", "train"])
    select_row = next(r for r in out["stages"] if r[0] == "select epoch")
    assert select_row[1].startswith("epoch ") and served == [0, 1, 2]
    report = _report(st)
    rows = {r["epoch"]: r for r in report["epochs"]}
    assert sorted(rows) == [0, 1, 2] and all(r["served_tau"] >= 1.0 and r["wall_s"] > 0 for r in rows.values())
    assert all(r["reused"] for r in rows.values()) and report["num_prompts"] == 2  # the held-out split
    estimates = old_cfg["selection"]["per_epoch"]
    assert {str(e): r["teacher_forced_estimate"] for e, r in rows.items()} == estimates
    assert report["spearman"] == spearman([estimates[str(e)] for e in rows], [r["served_tau"] for r in rows.values()])

    final, cfg = _final(st)
    best = max(r["served_tau"] for r in rows.values())
    assert final["selected_by"] == "served" and rows[final["epoch"]]["served_tau"] == best
    assert final["epoch"] == report["best_served_epoch"] == cfg["selection"]["epoch"]
    sel = cfg["selection"]
    assert sel["selected_by"] == "served" and "highest tau" in sel["by"] and sel["served_tau"] == best
    assert sel["estimate_selection"] == old_cfg["selection"] and sel["spearman"] == report["spearman"]
    assert {k: v for k, v in cfg.items() if k != "selection"} == {k: v for k, v in old_cfg.items() if k != "selection"}
    stage = Stage(st, "r", "train")  # final/ holds that epoch's checkpoint, byte for byte
    ckpt = stage.manifest(f"checkpoint-{final['epoch']:04d}")
    assert final["files"]["final/model.safetensors"]["sha256"] == \
        ckpt["files"][f"checkpoint-{final['epoch']:04d}/model.safetensors"]["sha256"]

    # reruns: nothing is served again
    again = run_pipeline(recipe, st, "r", stages=["train"])
    assert next(r for r in again["stages"] if r[0] == "select epoch")[1].startswith("skipped (committed")
    assert _final(st)[0]["committed_at"] == final["committed_at"]
    rerank = rank_epochs(recipe, st, "r")
    assert served == [0, 1, 2] and [r["served_tau"] for r in rerank["epochs"]] == [rows[e]["served_tau"] for e in rows]
    assert rerank["served_now_wall_s"] == 0 and rerank["served_ranking_wall_s"] == report["served_ranking_wall_s"]
    # another prompt count is another measurement
    rank_epochs(recipe, st, "r", num_prompts=1)
    assert served == [0, 1, 2, 0, 1, 2]


@pytest.mark.train
def test_compare_selects_a_served_arm_before_evaluating_it(tiny_recipe, tmp_path, monkeypatch):
    from eagle_jobs.capture import run_capture
    from eagle_jobs.compare import run_compare
    from eagle_jobs.extract import run_extract

    monkeypatch.setenv("EAGLE_JOBS_WORK_DIR", str(tmp_path / "work"))
    data = tiny_recipe(train={"epochs": 2}).model_dump(mode="json")
    data["variants"] = {"served": {"train": {"select_by": "served"}}}
    recipe = Recipe.model_validate(data)
    assert recipe.variant("served").train_digest() == recipe.train_digest()  # selection is not training
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    served = _served_counter(monkeypatch)
    report = run_compare(recipe, st, "r", only=["served"])
    assert served == [0, 1]
    final, cfg = _final(st, "variants/served/train")
    ranking = _report(st, "variants/served/epochs")
    assert final["selected_by"] == "served" and final["epoch"] == ranking["best_served_epoch"]
    (row,) = report["variants"]
    assert row["selection"]["selected_by"] == "served" and row["selection"]["epoch"] == final["epoch"]
    ev = Stage(st, "r", "variants/served/eval")  # evaluate measured the selected final/
    ev_report = json.loads(ev.read("report.json", ev.manifest("report")["files"]["report.json"]))
    assert ev_report["train"]["selection"] == cfg["selection"]
    assert not Stage(st, "r", "epochs").manifests()  # the run's own epochs are not the arm's


def test_select_by_served_is_refused_before_training_where_it_cannot_serve(tiny_recipe, tmp_path, monkeypatch):
    from eagle_jobs.pipeline import run_pipeline

    st = Store.open(f"file://{tmp_path}/s")
    no_held_out = tiny_recipe(prompts={"validation": 0}, train={"select_by": "served"},
                              evaluate={"prompt_sets": {"more": str(write_prompts(tmp_path / "more.jsonl", 3))}})
    with pytest.raises(BadInput, match="has none: set prompts.validation"):
        run_pipeline(no_held_out, st, "r")
    sidecar = tiny_recipe(train={"select_by": "served"}, evaluate={"backend": "vllm"})
    monkeypatch.setenv("EAGLE_JOBS_VLLM_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(BadInput, match="one vLLM server per epoch checkpoint"):
        run_pipeline(sidecar, st, "r")
    assert not st.list("r")  # nothing ran
    # the evaluate job of a pipeline overlay (its vLLM sidecar serves final/ only): one line, exit 3
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(sidecar.model_dump(mode="json")))
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "evaluate", "--recipe", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "one vLLM server per epoch checkpoint" in r.stderr


# -- real vLLM -----------------------------------------------------------------------------------------------
def _vllm_recipe(root: Path) -> Recipe:
    prompts = root / "prompts.jsonl"
    topics = ["the sea", "prime numbers", "a red fox", "photosynthesis", "the moon", "bread", "rivers", "music"]
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {t}."}]}) + "\n"
                               for t in topics))
    serve = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024"]
    return Recipe.model_validate({
        "name": "epochs-vllm", "verifier": {"model": EMBEDDED_SMOLLM2},
        "prompts": {"source": str(prompts), "validation": 2},
        "chat": {"reasoning_parser": None}, "sampling": {"temperature": 0.0, "max_new_tokens": 24},
        "limits": {"max_prompt_tokens": 200, "max_seq_len": 256}, "aux_layer_ids": [2, 15, 27],
        "capture": {"backend": "transformers"}, "extract": {"backend": "transformers"},
        "draft": {"draft_vocab_size": 1024},
        "train": {"epochs": 2, "lr": 1e-3, "total_seq_len": 256, "ttt_steps": 3},
        "evaluate": {"backend": "vllm", "num_speculative_tokens": 3, "max_new_tokens": 16,
                     "vllm": {"serve_args": serve, "health_timeout_s": 600, "port": free_port()}},
        "store": {"uri": f"file://{root}/store", "run_id": "r"},
    })


@pytest.mark.vllm
@pytest.mark.train
def test_rank_epochs_serves_each_epoch_with_real_vllm(tmp_path, monkeypatch):
    from eagle_jobs import vllm_cpu
    from eagle_jobs.capture import run_capture
    from eagle_jobs.evaluate.decode import evaluate_transformers
    from eagle_jobs.extract import run_extract
    from eagle_jobs.train.checkpoints import epoch_checkpoints, restore_served
    from eagle_jobs.train.run import run_train

    if not vllm_cpu.is_cpu_build():
        pytest.skip("vllm-cpu installs on Linux x86-64 only")
    monkeypatch.setenv("EAGLE_JOBS_WORK_DIR", str(tmp_path / "work"))
    recipe = _vllm_recipe(tmp_path)
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "r")
    run_extract(recipe, st, "r")
    run_train(recipe, st, "r")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    cli = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "rank-epochs", "--recipe", str(path),
                          "--num-prompts", "2"], capture_output=True, text=True, timeout=1500)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "Spearman's rank correlation" in cli.stderr and "| 1 " in cli.stderr  # the console is stderr
    report = _report(st)
    assert [r["epoch"] for r in report["epochs"]] == [0, 1] and report["backend"] == "vllm"
    # each served tau is that epoch's checkpoint, exported as final/ would hold it: the transformers
    # loop on the same files and prompts gives the same tau (fp32, greedy)
    prompts, _ = epochs.held_out_prompts(recipe, 2)
    stage = Stage(st, "r", "train")
    for row in report["epochs"]:
        draft = restore_served(stage, epoch_checkpoints(stage)[row["epoch"]], tmp_path / f"e{row['epoch']}")
        ours = evaluate_transformers(recipe, draft, prompts, untrained=False)
        assert row["served_tau"] == pytest.approx(ours["acceptance_length"], abs=1e-9)
        assert row["verifier_forwards"] == ours["rounds"] and row["wall_s"] > 0
        # a server this process started: its runner and attention backend read from its own log
        assert row["engine"]["model_runner"] in ("V1", "V2") and row["engine"]["engine"] == "vllm"
        assert not row["engine"]["attention_backend"].startswith("not seen")
    assert report["served_ranking_wall_s"] == pytest.approx(sum(r["wall_s"] for r in report["epochs"]), abs=0.05)

    served = _served_counter(monkeypatch)  # a rerun reads every epoch back: no server starts
    again = rank_epochs(recipe, st, "r", num_prompts=2)
    assert served == [] and all(r["reused"] for r in again["epochs"])
    assert [r["served_tau"] for r in again["epochs"]] == [r["served_tau"] for r in report["epochs"]]
    served_by = recipe.model_copy(update={"train": recipe.train.model_copy(update={"select_by": "served"})})
    assert select_served(served_by, st, "r", num_prompts=2).startswith("epoch ")  # from the committed ranking
    assert served == [] and _final(st)[0]["epoch"] == again["best_served_epoch"]
