"""`eagle-jobs promote`: a run's draft becomes the stable one only if it is at least as good.

Layout under the destination (e.g. s3://bucket/runs/drafts/kimi-k2.5):
    versions/<run-id>/...        the checkpoint, report.json/.md and lineage.json
    CURRENT.json                 which version is promoted, its tau, evaluation prompts and engine

The version is copied completely before CURRENT.json is replaced (one PUT), so a
reader never sees a half-promoted draft.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time

from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.layout import StageName
from eagle_jobs.progress import console
from eagle_jobs.settings import settings
from eagle_jobs.store import Stage, Store


def _git_commit() -> str | None:
    if given := settings().git_commit or os.environ.get("GITHUB_SHA"):  # GitHub Actions sets it
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _manifest_hashes(store: Store, run_id: str) -> dict[str, str]:
    """One sha256 per stage over its manifests: the exact data a draft was trained on."""
    out = {}
    for stage in (StageName.CAPTURE.dir, StageName.EXTRACT.dir):
        st = Stage(store, run_id, stage)
        h = hashlib.sha256()
        for key in st.store.list(st.key("manifests")):
            h.update(key.encode())
            h.update(store.get(key))
        out[stage] = h.hexdigest()
    return out


def speedup_at_1(prompt_set: dict) -> float | None:
    """A prompt set's measured speedup at concurrency 1 (report.json), or None where it was not measured."""
    return next((lv["speedup"] for lv in (prompt_set.get("speedup") or {}).get("levels", [])
                 if lv["concurrency"] == 1), None)


def check_speedup(report: dict, run_id: str, min_speedup: float | None) -> None:
    """With a threshold, every prompt set's speedup at concurrency 1 must reach it: a draft that is
    accepted often but slows serving down is not what anyone deploys."""
    if min_speedup is None:
        return
    from eagle_jobs.recipe import LONG_OUTPUT_SET

    # the long-output set is for τ by position: evaluate never times it
    sets = {n: x for n, x in (report.get("prompt_sets") or {}).items() if n != LONG_OUTPUT_SET}
    missing = [n for n, x in sets.items() if speedup_at_1(x) is None]
    if missing or not sets:
        raise BadInput(f"promote: a speedup of at least {min_speedup:.2f}x at concurrency 1 is required, and run "
                       f"'{run_id}' has none measured for {missing or 'any set'} ({report.get('speedup_note')}): "
                       "evaluate on the vllm backend where the stage starts its servers, or drop the threshold")
    # every set has a speedup here (missing ones are refused above); the None test is for the type
    slow = {n: sp for n, x in sets.items() if (sp := speedup_at_1(x)) is not None and sp < min_speedup}
    if slow:
        raise EagleJobsError("promote: not promoted: " + "; ".join(
            f"speedup[{n}] {sp:.2f}x at concurrency 1 < min_speedup {min_speedup:.2f}x" for n, sp in slow.items()),
            ExitCode.NOT_BETTER)


def serving_of(report: dict, dest: Store, prefix: str, run_id: str) -> dict | None:
    """The serving config with the promoted draft's directory in it (None: a report from before evaluate
    wrote one). A file:// destination's version directory is the draft vLLM loads; from S3 it is first
    copied to ./eagle3-<run-id> (the `download` line)."""
    from eagle_jobs.deploy import serve_line, with_draft

    advice = report.get("serving")
    if not advice:
        return None
    if dest.is_s3:
        local, download = f"./eagle3-{run_id}", f"aws s3 cp --recursive {dest.url(prefix)}/ ./eagle3-{run_id}/"
    else:
        local, download = dest.path(prefix), None
    advice = with_draft(advice, local)
    return {**advice, "draft": local, "download": download, "line": serve_line(advice)}


def shared_sets(report: dict, current: dict, run_id: str, tau: float, sets: dict) -> dict:
    """{set: (candidate τ, promoted τ)} on every prompt set both were measured on, each on its own."""
    cur_sets = current.get("prompt_sets") or {}
    same = {n for n in sets if n in cur_sets and cur_sets[n]["prompts_sha256"] == sets[n]["prompts_sha256"]}
    if not same and current.get("prompts_sha256") != report.get("prompts_sha256"):
        raise BadInput(f"promote: '{run_id}' was evaluated on other prompts than the promoted "
                       f"'{current['run_id']}' ({report.get('prompts_sha256')} "
                       f"vs {current.get('prompts_sha256')}): "
                       "evaluate both with the same --prompts file or evaluate.prompt_sets")
    return {n: (sets[n]["acceptance_length"], cur_sets[n]["acceptance_length"]) for n in sorted(same)} or \
        {"prompts": (tau, current["acceptance_length"])}


def check_engines(report: dict, current: dict, run_id: str) -> None:
    """τ compares only under one engine (evaluate.engine.engine_record's key): another vLLM version, model runner,
    attention backend, rejection rule or sampling moves it without the draft changing (vLLM #40551)."""
    from eagle_jobs.evaluate.engine import describe_engine

    new, old = report.get("engine"), current.get("engine")
    if not new or not old or new["key"] != old["key"]:
        raise BadInput(f"promote: '{run_id}' was measured on {describe_engine(new)}; the promoted "
                       f"'{current['run_id']}' on {describe_engine(old)}: τ from two engines is not compared. "
                       "Pass --across-engines to measure both drafts again on this machine's engine")


def remeasure(store: Store, run_id: str, dest: Store, current: dict) -> tuple[dict, dict, dict]:
    """Both drafts on this process's engine, on the candidate recipe's prompt sets: (engine, the
    candidate's {set: {acceptance_length, prompts_sha256}}, the promoted draft's)."""
    import tempfile
    from pathlib import Path

    from eagle_jobs.committed import download_final
    from eagle_jobs.evaluate.run import tau_on_this_engine
    from eagle_jobs.evaluate.sets import eval_sets
    from eagle_jobs.recipe import Recipe

    work = Path(tempfile.mkdtemp(prefix="eagle-promote-"))
    candidate = download_final(store, run_id, work / "candidate")
    recipe = Recipe.model_validate(json.loads((candidate / "recipe.json").read_text()))
    promoted, prefix = work / "promoted", f"versions/{current['run_id']}/"
    promoted.mkdir(parents=True)
    for key in dest.list(prefix):  # the promoted checkpoint's files, not its eval/ or lineage (module doc)
        rel = key.rstrip("/").split(prefix, 1)[1]
        if rel not in ("eval", "lineage.json"):
            (promoted / rel).write_bytes(dest.get(key))
    sets = eval_sets(recipe)
    engine, new = tau_on_this_engine(recipe, candidate, sets)
    _, old = tau_on_this_engine(recipe, promoted, sets)
    console.print(f"promote --across-engines: both drafts measured on {engine['engine']} {engine['version']}")
    return dict(engine), new, old


def promote(store: Store, run_id: str, dest_uri: str, tolerance: float = 0.01,
            image_digests: dict[str, str] | None = None, min_speedup: float | None = None,
            across_engines: bool = False) -> dict:
    """min_speedup: the threshold at concurrency 1; None takes the one evaluate recorded from the recipe
    (evaluate.min_speedup), which may be None too (no rule). across_engines: against a draft promoted on
    another engine, measure both again here (remeasure) and compare those; else such a draft is refused."""
    train, ev = Stage(store, run_id, StageName.TRAIN.dir), Stage(store, run_id, StageName.EVALUATE.dir)
    final, report_m = train.manifest("final"), ev.manifest("report")
    if final is None or report_m is None:
        raise BadInput(f"promote: run '{run_id}' has no committed final checkpoint and evaluation report "
                       f"in {store.uri}")
    report = json.loads(ev.read("report.json", report_m["files"]["report.json"]))
    tau = float(report["acceptance_length"])
    check_speedup(report, run_id, min_speedup if min_speedup is not None else report.get("min_speedup"))
    dest = Store.open(dest_uri)
    dest.check()
    try:
        current = dest.get_json("CURRENT.json")
    except FileNotFoundError:
        current = None
    sets = {name: x for name, x in (report.get("prompt_sets") or {}).items()}
    engine, remeasured = report.get("engine"), None
    other_engine = current is not None and (current.get("engine") or {}).get("key") != (engine or {}).get("key")
    if current is not None and other_engine and across_engines:
        engine, new, old = remeasure(store, run_id, dest, current)
        remeasured = {"engine": engine, "candidate": new, "promoted": {"run_id": current["run_id"], "sets": old}}
        sets = {n: {**sets.get(n, {}), **x} for n, x in new.items()}  # the candidate's τ on this engine
        tau = next(iter(new.values()))["acceptance_length"]
        pairs = {n: (new[n]["acceptance_length"], old[n]["acceptance_length"]) for n in new}
    elif current is not None:
        check_engines(report, current, run_id)
        pairs = shared_sets(report, current, run_id, tau, sets)
    if current is not None:
        worse = {n: p for n, p in pairs.items() if p[0] + tolerance < p[1]}
        if worse:
            msg = "promote: not promoted: " + "; ".join(
                f"tau[{n}] {new:.3f} < promoted '{current['run_id']}' {old:.3f} - {tolerance}"
                for n, (new, old) in worse.items())
            raise EagleJobsError(msg, ExitCode.NOT_BETTER)
    prefix = f"versions/{run_id}"
    for f, info in final["files"].items():  # checkpoint objects, each checked against its manifest
        dest.put(f"{prefix}/{f.split('/', 1)[1]}", train.read(f, info))
    for f, info in report_m["files"].items():
        dest.put(f"{prefix}/eval/{f}", ev.read(f, info))
    train_cfg = json.loads(dest.get(f"{prefix}/train_config.json"))
    recipe = json.loads(dest.get(f"{prefix}/recipe.json"))
    lineage = {
        "run_id": run_id, "recipe_digest": train_cfg.get("recipe_digest"),
        "verifier": recipe["verifier"]["model"], "verifier_revision": recipe["verifier"].get("revision"),
        "data_manifests_sha256": _manifest_hashes(store, run_id), "git_commit": _git_commit(),
        # what submit --image pinned (recorded by train from the run's ConfigMap), or what the caller says
        "image_digests": image_digests or train_cfg.get("image_digests") or
        settings().image_digests,
        "acceptance_length": tau, "per_position_acceptance": report["per_position_acceptance"],
        "prompts_sha256": report.get("prompts_sha256"), "report": dest.url(f"{prefix}/eval/report.md"),
        "prompt_sets": {n: x["acceptance_length"] for n, x in sets.items()},
        "speedup_at_concurrency_1": {n: speedup_at_1(x) for n, x in sets.items()},
        "source": store.url(train.key("data/final")), "promoted_at": time.time(),
        "previous": current["run_id"] if current else None,
        # the engine every τ above was measured on; remeasured: both drafts again on it (--across-engines)
        "engine": engine, "remeasured_across_engines": remeasured,
    }
    serve = serving_of(report, dest, prefix, run_id)
    if serve is not None:
        dest.put_json(f"{prefix}/serve.json", serve)
    dest.put_json(f"{prefix}/lineage.json", lineage)
    dest.put_json("CURRENT.json", {"run_id": run_id, "version": dest.url(prefix), "acceptance_length": tau,
                                   "prompts_sha256": report.get("prompts_sha256"), "engine": engine,
                                   "lineage": dest.url(f"{prefix}/lineage.json"), "serve": serve,
                                   "prompt_sets": {n: {"acceptance_length": x["acceptance_length"],
                                                       "prompts_sha256": x["prompts_sha256"]}
                                                   for n, x in sets.items()}})
    console.print(f"promoted '{run_id}' (tau {tau:.3f}"
                  + (f", was {current['acceptance_length']:.3f} from '{current['run_id']}'" if current else "")
                  + f") to {dest.url(prefix)}")
    if serve is not None:
        console.print("serve it with:\n" + "\n".join(x for x in (serve["download"], serve["line"]) if x),
                      soft_wrap=True, markup=False, highlight=False)
    return lineage


def report_summary(store: Store, run_id: str) -> str:
    """Markdown for a CI job summary: τ per prompt set beside its untrained baseline, and the report."""
    ev = Stage(store, run_id, StageName.EVALUATE.dir)
    m = ev.manifest("report")
    if m is None:
        return f"### {run_id}\n\nno evaluation report yet\n"
    rep = json.loads(ev.read("report.json", m["files"]["report.json"]))
    lines = [f"### {run_id}", "",
             f"k = {rep['num_speculative_tokens']}; report: {store.url(ev.key('data/report.md'))}", "",
             "| prompt set | prompts | τ | untrained | per-position acceptance | speedup at concurrency 1 |",
             "|---|---|---|---|---|---|"]
    for name, x in (rep.get("prompt_sets") or {"prompts": rep}).items():
        base, sp = x.get("baseline_acceptance_length"), speedup_at_1(x)
        lines.append(f"| {name} | {x['num_prompts']} | {x['acceptance_length']:.3f} | "
                     f"{'-' if base is None else f'{base:.3f}'} | "
                     f"{' / '.join(f'{a:.2f}' for a in x['per_position_acceptance'])} | "
                     f"{'-' if sp is None else f'{sp:.2f}x'} |")
    return "\n".join(lines) + "\n"


def reconcile(store: Store, dest_uri: str, prefix: str = "", tolerance: float = 0.01,
              min_speedup: float | None = None) -> list[dict]:
    """Decide, once, every run whose evaluation is complete: promote it if it is at least as good.

    CI submits a run and returns (a GitHub-hosted job dies at 6 hours; a Kimi-K2.5 run takes days);
    this runs on a schedule instead, where waiting costs nothing. Each decision is written to
    <dest>/decisions/<run-id>.json, so a run is decided once, whatever the schedule. Runs still in
    progress are left for a later pass.
    """
    dest = Store.open(dest_uri)
    dest.check()
    decided = []
    for key in store.list(""):
        run_id = key.rstrip("/").rsplit("/", 1)[-1]
        if not run_id.startswith(prefix) or not Stage(store, run_id, StageName.EVALUATE.dir).is_complete():
            continue
        if dest.exists(f"decisions/{run_id}.json"):
            continue
        try:
            lineage = promote(store, run_id, dest_uri, tolerance, min_speedup=min_speedup)
            decision = {"run_id": run_id, "promoted": True, "why": "at least as good on every shared prompt set",
                        "lineage": dest.url(f"versions/{run_id}/lineage.json")}
        except EagleJobsError as e:  # not better (9) or not comparable (3): decided, not retried
            if e.code not in (ExitCode.NOT_BETTER, ExitCode.BAD_INPUT):
                raise
            lineage, decision = None, {"run_id": run_id, "promoted": False, "why": str(e)}
        decision["decided_at"] = time.time()
        dest.put_json(f"decisions/{run_id}.json", decision)
        decision["summary"] = report_summary(store, run_id)
        decided.append(decision)
        console.print(f"reconcile: {run_id}: {'promoted' if lineage else 'kept the promoted draft'}")
    return decided
