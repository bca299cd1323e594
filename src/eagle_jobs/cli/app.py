"""The `eagle-jobs` application: its options, how a command finds its recipe, store and run id, and `main`,
which turns every failure we can name into one line on stderr and an exit code from
eagle_jobs.errors.ExitCode (documented in docs/OPERATIONS.md#exit-codes).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle_jobs.errors import BadInput, EagleJobsError, ExitCode
from eagle_jobs.settings import settings

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train EAGLE-3 drafts for very large verifiers: capture -> extract -> train -> evaluate. "
                  "Start with `eagle-jobs run --recipe jobs/demo.yaml` (make demo). Pod-internal commands "
                  "(serve-vllm, exec-vllm, guard) are hidden.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"eagle-jobs {version('eagle-jobs')}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """Train EAGLE-3 drafts for very large verifiers: capture -> extract -> train -> evaluate."""

EXIT_CODES = ("Exit codes: 0 done; 1 unexpected error; 2 usage; 3 bad input (recipe, prompts, checkpoint: do not "
              "retry); 4 store unreachable; 5 a server never became healthy; 6 checkpoint vLLM would not load; 7 an "
              "upstream stage not committed yet; 8 no cluster; 9 not better than the promoted draft; 10 disk full; "
              "11 a run of the recipe still running; 12 a pod of the run cannot start; 130 ^C; 143 SIGTERM "
              "(state committed: rerun to resume). docs/OPERATIONS.md#exit-codes")


RecipeOpt = Annotated[Path, typer.Option("--recipe", "-r", help="jobs/<name>.yaml")]
StoreOpt = Annotated[Optional[str], typer.Option("--store",
                                                 help="file://... or s3://bucket/prefix (default: the recipe's)")]


def run_id_option(value: str | None) -> str | None:
    """--run-id, checked while the command line is parsed: before any recipe, store or server."""
    from eagle_jobs.runid import check_run_id

    return None if value is None else check_run_id(value, "--run-id")


def _run_id_argument(value: str | None) -> str | None:
    from eagle_jobs.runid import check_run_id

    return None if value is None else check_run_id(value, "RUN_ID")


RunOpt = Annotated[Optional[str], typer.Option("--run-id",
                                               help="run id (default: $EAGLE_JOBS_RUN_ID, else the recipe's)",
                                               callback=run_id_option)]
# status, watch, logs and promote took the run id as an argument before every command took --run-id:
# still accepted, with a one-line notice
RunIdArg = Annotated[Optional[str], typer.Argument(help="the run id, the old way: use --run-id",
                                                   callback=_run_id_argument, show_default=False, metavar="RUN_ID")]
IndexOpt = Annotated[Optional[int], typer.Option("--shard-index", help="this worker (default: $JOB_COMPLETION_INDEX)")]
VariantOpt = Annotated[Optional[str], typer.Option(help="one arm of `compare` (recipe variants)")]
MinSpeedupOpt = Annotated[Optional[float], typer.Option(
    help="require this speedup at concurrency 1 on every prompt set (default: the recipe's evaluate.min_speedup)")]
NumOpt = Annotated[Optional[int], typer.Option("--num-shards",
                                               help="number of workers (default: $EAGLE_JOBS_NUM_SHARDS)")]


def context(recipe_path: Path, store: str | None, run_id: str | None):
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.store import Store

    recipe = load_recipe(recipe_path, store)  # checks the recipe's store.run_id
    rid = run_id or env_run_id() or recipe.store.run_id  # before the store is opened: it may write
    st = Store.open(store or settings().store or recipe.store.uri)
    st.check()
    return recipe, st, rid


def one_run_id(ctx: typer.Context, positional: str | None, option: str | None) -> str:
    """The run a cluster or promote command names: --run-id, else the old positional argument (with a
    notice), else $EAGLE_JOBS_RUN_ID."""
    command = ctx.command_path.removeprefix("eagle-jobs ")
    if positional and option and positional != option:
        raise BadInput(f"{command}: run id '{positional}' as an argument and '{option}' as --run-id: give one")
    if positional and not option:
        print(f"eagle-jobs {command}: the run id as an argument is the old way: use --run-id {positional}",
              file=sys.stderr)
    rid = option or positional or env_run_id()
    if not rid:
        print(_usage_line("Missing option '--run-id'.", ctx), file=sys.stderr)
        raise typer.Exit(int(ExitCode.USAGE))
    return rid


def env_run_id() -> str | None:
    from eagle_jobs.runid import check_run_id

    value = settings().run_id
    return check_run_id(value, "$EAGLE_JOBS_RUN_ID") if value else None


def recipe_arm(recipe, variant: str | None):
    """A variant of the recipe's `variants:`; a rank of a variant gets its arm's recipe already applied."""
    return recipe.variant(variant) if variant and recipe.variants else recipe


def store_or_none(uri: str | None):
    from eagle_jobs.store import Store

    uri = uri or settings().store
    if not uri:
        return None
    st = Store.open(uri)
    st.check()
    return st


def _click_errors() -> tuple[type[Exception], ...]:
    """click's exception types. typer >= 0.24 carries its own copy of click (typer._click), whose
    exceptions derive from typer.TyperException, not click.ClickException: checking only the latter
    let every usage error escape as a traceback."""
    import click

    return (click.ClickException, *(t for t in [getattr(typer, "TyperException", None)] if t is not None))


def _usage_line(e: Exception | str, ctx=None) -> str:
    """One line: what was wrong, the command's usage, where the help is."""
    ctx = ctx or getattr(e, "ctx", None)
    what = e if isinstance(e, str) else e.format_message() if hasattr(e, "format_message") else str(e)
    if ctx is None:
        return f"eagle-jobs: error: {what}"
    return (f"eagle-jobs: error: {what} (usage: {ctx.get_usage().removeprefix('Usage: ').strip()}; "
            f"try '{ctx.command_path} --help')")


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # click returns typer.Exit's code instead of raising it
        if rc == ExitCode.CANCELLED:  # typer turns ^C (KeyboardInterrupt) into Exit(130), which click returns
            print("eagle-jobs: interrupted", file=sys.stderr)
        sys.exit(rc if isinstance(rc, int) else 0)
    except EagleJobsError as e:
        print(f"eagle-jobs: error: {e}", file=sys.stderr)
        # a training rank: tell the launcher (train.launch.launch_ranks). Read directly, not through settings():
        # the error path must not fail on another variable that does not validate
        if os.environ.get("EAGLE_JOBS_RANK_EXITS"):
            from eagle_jobs.train.launch import record_rank_exit

            record_rank_exit(e.code)
        sys.exit(int(e.code))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("eagle-jobs: interrupted", file=sys.stderr)
        sys.exit(int(ExitCode.CANCELLED))
    except _click_errors() as e:
        # bare `eagle-jobs`: the help is the answer (the error's show() prints it)
        if type(e).__name__ == "NoArgsIsHelpError" and hasattr(e, "show"):
            e.show()
            sys.exit(int(ExitCode.USAGE))
        print(_usage_line(e), file=sys.stderr)
        sys.exit(int(ExitCode.USAGE) if getattr(e, "exit_code", 2) == 2 else int(ExitCode.BAD_INPUT))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {e.filename}" if e.filename else ""
        print(f"eagle-jobs: error: no space left on a disk{where} ({e.strerror}): free space on the store's disk, "
              "the work dir or the scratch dir (df -h), then rerun: committed shards are kept", file=sys.stderr)
        sys.exit(int(ExitCode.NO_SPACE))
    except Exception as e:
        if type(e).__module__.split(".")[0] == "urllib3":  # the cluster's API server did not answer
            print(f"eagle-jobs: error: cluster API unreachable ({type(e).__name__}: {str(e).splitlines()[0]}): "
                  "check --kubeconfig / $KUBECONFIG and the network", file=sys.stderr)
            sys.exit(int(ExitCode.NO_CLUSTER))
        raise
