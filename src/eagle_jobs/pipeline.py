"""`eagle-jobs run`: every stage in order, each skipped when already committed."""

from __future__ import annotations

import threading
import time

from rich.table import Table

from eagle_jobs.errors import BadInput
from eagle_jobs.layout import STAGES, STREAM, StageName, epochs_dir
from eagle_jobs.progress import console
from eagle_jobs.recipe import Recipe
from eagle_jobs.store import Stage, Store


def select_by_served(recipe: Recipe, store: Store, run_id: str) -> tuple[str, str, str, str]:
    """train.select_by served: final/ becomes the best-served epoch before evaluate (eagle_jobs.epochs)."""
    from eagle_jobs.epochs import select_served

    t0 = time.perf_counter()
    if Stage(store, run_id, StageName.EVALUATE.dir).is_complete():  # never swap the draft under its report
        status = "skipped (evaluate is committed: final/ stays the draft it measured)"
    else:
        console.rule("[bold]select epoch (served tau)")
        status = select_served(recipe, store, run_id)
    where = store.url(Stage(store, run_id, epochs_dir()).prefix)
    return ("select epoch", status, f"{time.perf_counter() - t0:.0f}s", where)


def run_streamed(recipe: Recipe, store: Store, run_id: str) -> dict:
    """train.source stream: extraction in a thread beside training, which reads its shards as they
    commit; the store's extraction bytes are sampled every second for the peak."""
    from eagle_jobs import stream
    from eagle_jobs.extract import run_extract
    from eagle_jobs.train.run import run_train

    stream.clear_failed(store, run_id)
    done, peak, ended = threading.Event(), [0], [0.0]

    def extract() -> None:
        try:
            run_extract(recipe, store, run_id, 0, 1)
        except BaseException as e:  # training waits on shards: tell it, in one line, then stop the run
            stream.mark_failed(store, run_id, f"{type(e).__name__}: {e}"[:400])
            raise
        finally:
            ended[0] = time.time()
            done.set()

    def sample() -> None:
        while not done.wait(1.0):
            peak[0] = max(peak[0], stream.stored_bytes(store, run_id))

    started = time.time()
    threads = [threading.Thread(target=f, name=f.__name__, daemon=True) for f in (extract, sample)]
    for t in threads:
        t.start()
    record = run_train(recipe, store, run_id)
    for t in threads:
        t.join()
    if not Stage(store, run_id, StageName.EXTRACT.dir).is_complete():
        raise BadInput(f"extract of run '{run_id}' did not complete (its error is above); rerun to resume")
    first = (record.get("stream") or {}).get("first_step_at") or ended[0]
    summary = {"window_bytes": recipe.store.window_bytes, "peak_store_bytes": peak[0],
               "train_first_step_s": round(first - started, 1), "extract_end_s": round(ended[0] - started, 1),
               "overlap_s": round(max(0.0, ended[0] - first), 1)}
    store.put_json(f"{run_id}/{STREAM}/summary.json", summary)
    console.print(f"stream: training's first step {summary['train_first_step_s']} s after the start, extraction "
                  f"ended at {summary['extract_end_s']} s (overlap {summary['overlap_s']} s); peak extraction bytes "
                  f"on the store {stream.mib(peak[0])}, window {stream.mib(recipe.store.window_bytes or 0)}")
    return summary


def run_pipeline(recipe: Recipe, store: Store, run_id: str, stages: list[str] | None = None) -> dict:
    from eagle_jobs.capture import run_capture
    from eagle_jobs.evaluate.run import run_evaluate
    from eagle_jobs.extract import run_extract
    from eagle_jobs.train.run import run_train

    wanted = stages or STAGES
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise BadInput(f"--stages: unknown stage(s) {unknown}; choose from {STAGES}")
    if "evaluate" in wanted:
        from eagle_jobs.evaluate.sets import eval_sets

        eval_sets(recipe)  # no held-out split and no benchmark set: refused now, not after training
    select = recipe.train.select_by == "served" and bool({"train", "evaluate"} & set(wanted))
    if select:
        from eagle_jobs.epochs import DEFAULT_PROMPTS, check_servable, held_out_prompts

        check_servable(recipe)  # likewise: the ranking's servers and prompts, before training
        held_out_prompts(recipe, DEFAULT_PROMPTS)
    runners = {
        "capture": lambda: run_capture(recipe, store, run_id, 0, 1),
        "extract": lambda: run_extract(recipe, store, run_id, 0, 1),
        "train": lambda: run_train(recipe, store, run_id),
        "evaluate": lambda: run_evaluate(recipe, store, run_id),
    }
    streamed = recipe.train.source == "stream" and {"extract", "train"} <= set(wanted)
    if streamed:  # one step: extraction beside training
        runners["extract"] = lambda: run_streamed(recipe, store, run_id)
    rows, tau, extract_streamed = [], None, False
    for name in STAGES:
        if name == "evaluate" and select:  # after training (run now or committed), before evaluate
            rows.append(select_by_served(recipe, store, run_id))
        if name not in wanted:
            continue
        stage = Stage(store, run_id, StageName(name).dir)
        t0 = time.perf_counter()
        if name == "train" and extract_streamed:
            status = "done (its time is extract's: they ran together)"
        elif stage.is_complete():
            status = "skipped (committed)"
        else:
            console.rule(f"[bold]{name}")
            runners[name]()
            extract_streamed = streamed and name == "extract"
            status = "streamed into train" if extract_streamed else "done"
        if name == "evaluate":
            tau = (stage.completion() or {}).get("acceptance_length")
        rows.append((name, status, f"{time.perf_counter() - t0:.0f}s", store.url(stage.prefix)))
    table = Table(title=f"eagle-jobs run '{run_id}' ({recipe.name})")
    for col in ("stage", "status", "time", "artifacts"):
        table.add_column(col)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    if tau is not None:
        console.print(f"[bold]acceptance length tau = {tau:.3f}[/] at k={recipe.evaluate.k}; "
                      f"report: {store.url(Stage(store, run_id, StageName.EVALUATE.dir).key('data/report.md'))}")
    return {"stages": rows, "acceptance_length": tau}
