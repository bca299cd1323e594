"""store:<key> references: the bucket is one setting ($EAGLE_JOBS_STORE, --store or store.uri), and the recipes,
the overlays and the commands name the store's objects relative to it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle_jobs.errors import BadInput, ExitCode
from eagle_jobs.recipe_file import load_recipe, recipe_from_text
from eagle_jobs.store import Store
from eagle_jobs.store_refs import resolve_ref

REPO = Path(__file__).resolve().parents[1]
KIMI = REPO / "jobs/kimi-k2.5.yaml"


def test_a_recipe_names_store_objects_once_and_they_follow_the_store(monkeypatch):
    """--store, else $EAGLE_JOBS_STORE, else the recipe's store.uri; a resolved recipe equals (digests
    included) the recipe that spells the same URIs out."""
    monkeypatch.delenv("EAGLE_JOBS_STORE", raising=False)
    text = KIMI.read_text()
    assert "store:models/" in text and "s3://" not in text
    r = load_recipe(KIMI, "s3://other-bucket")
    assert r.verifier.weights == ("s3://other-bucket/models/moonshotai/Kimi-K2.5/"
                                  "4d01dfe0332d63057c186e0b262165819efb6611")
    assert r.prompts.source == "s3://other-bucket/prompts/kimi-k2.5-prompts.jsonl"
    spelled = text.replace(": store:", ": s3://other-bucket/")
    same = recipe_from_text(spelled)
    assert same.digest() == r.digest() and same.train_digest() == r.train_digest()

    monkeypatch.setenv("EAGLE_JOBS_STORE", "s3://from-env/")
    assert load_recipe(KIMI).prompts.source == "s3://from-env/prompts/kimi-k2.5-prompts.jsonl"
    assert load_recipe(KIMI, "s3://flag").prompts.source == "s3://flag/prompts/kimi-k2.5-prompts.jsonl"
    monkeypatch.delenv("EAGLE_JOBS_STORE")
    local = load_recipe(KIMI)  # the recipe's own store.uri: the default, a directory here
    assert local.prompts.source == f"file://{Path('store').absolute()}/prompts/kimi-k2.5-prompts.jsonl"


def test_evaluate_prompt_sets_resolve_too_and_a_bad_reference_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_JOBS_STORE", "s3://b")
    raw = yaml.safe_load(KIMI.read_text())
    raw["evaluate"]["prompt_sets"] = {"mine": "store:prompts/mine.jsonl", "he": "pypi://humaneval"}
    raw["evaluate"]["long_output"] = {"source": "store:prompts/long.jsonl"}
    r = recipe_from_text(yaml.safe_dump(raw))
    assert r.evaluate.prompt_sets == {"mine": "s3://b/prompts/mine.jsonl", "he": "pypi://humaneval"}
    assert r.evaluate.long_output is not None and r.evaluate.long_output.source == "s3://b/prompts/long.jsonl"
    raw["verifier"]["weights"] = "store:../elsewhere"
    with pytest.raises(BadInput) as e:
        recipe_from_text(yaml.safe_dump(raw), "r.yaml")
    assert e.value.code == ExitCode.BAD_INPUT and "\n" not in str(e.value)
    assert str(e.value).startswith("recipe r.yaml: key 'verifier.weights': 'store:../elsewhere' names no object")
    with pytest.raises(BadInput, match="no store is set: pass --store or set"):
        resolve_ref("store:drafts/x", None)
    assert resolve_ref("s3://a/b", None) == "s3://a/b" and resolve_ref("pypi://humaneval", "s3://x") == "pypi://humaneval"


def test_the_bucket_is_written_once_in_the_cluster_files_and_every_overlay_keeps_it(rendered):
    """k8s/base's eagle-jobs-run ConfigMap holds the one store URI; no recipe or overlay restates the bucket,
    every overlay's pods get the base's value, and the recipe each overlay ships resolves against it."""
    files = [p for d in ("jobs", "k8s") for p in (REPO / d).rglob("*") if p.suffix in (".yaml", ".yml")]
    holders = sorted(str(p.relative_to(REPO)) for p in files if re.search(r"s3://[a-z0-9]", p.read_text()))
    assert holders == ["k8s/base/kustomization.yaml"], holders
    (base_uri,) = re.findall(r"EAGLE_JOBS_STORE=(\S+)", (REPO / "k8s/base/kustomization.yaml").read_text())
    for overlay, docs in rendered.items():
        cms = {d["metadata"]["name"].rsplit("-", 1)[0]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
        assert cms["eagle-jobs-run"]["EAGLE_JOBS_STORE"] == base_uri, overlay
        store = cms["eagle-jobs-run"]["EAGLE_JOBS_STORE"]
        recipe = recipe_from_text(cms["eagle-jobs-recipe"]["recipe.yaml"], overlay, store)
        for ref in (recipe.verifier.weights, recipe.prompts.source):
            assert not (ref or "").startswith("s3://") or (ref or "").startswith(base_uri + "/"), (overlay, ref)
        if overlay == "full":
            assert recipe.verifier.weights == f"{base_uri}/models/moonshotai/Kimi-K2.5/{recipe.verifier.revision}"


def test_the_dev_cluster_creates_the_bucket_the_store_setting_names(rendered, tmp_path):
    """components/minio's create-bucket runs `mc mb` on the bucket of $EAGLE_JOBS_STORE, run here by sh with an
    `mc` that records its arguments, under the env the rendered pod gets."""
    (js,) = [d for d in rendered["dev"] if d["kind"] == "JobSet"]
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (c,) = [c for c in pod["initContainers"] if c["name"] == "create-bucket"]
    (run_cm,) = [d["data"] for d in rendered["dev"]
                 if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("eagle-jobs-run")]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "mc").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/mc.log\n')
    (bindir / "mc").chmod(0o755)
    for store, bucket in ((run_cm["EAGLE_JOBS_STORE"], "eagle-jobs"), ("s3://my-team/eagle/runs", "my-team")):
        (tmp_path / "mc.log").unlink(missing_ok=True)
        env = {**run_cm, "EAGLE_JOBS_STORE": store, "PATH": f"{bindir}:/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "k",
               "AWS_SECRET_ACCESS_KEY": "s"}
        r = subprocess.run(c["command"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "mc.log").read_text().splitlines()[-1] == f"mb --ignore-existing dev/{bucket}"


def test_commands_write_store_references_into_the_store(tmp_path):
    """prompts build --out store:prompts/<file> lands in the store --store names (promote's and reconcile's
    --to resolve the same way, against the store they read)."""
    store = tmp_path / "store"
    src = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(6)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k != "EAGLE_JOBS_STORE"}
    p = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "prompts", "build", "--size", "5", "--source",
                        str(src), "--out", "store:prompts/mix.jsonl", "--store", f"file://{store}"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert len(Store.open(f"file://{store}").get("prompts/mix.jsonl").splitlines()) == 5
    bad = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "prompts", "build", "--size", "5", "--source",
                          str(src), "--out", "store:prompts/mix.jsonl"], capture_output=True, text=True, env=env)
    assert bad.returncode == 3 and bad.stderr.strip().count("\n") == 0 and "no store is set" in bad.stderr
