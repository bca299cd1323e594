"""The test tiers hold: a test outside the `vllm` tier cannot start real vLLM, in its own process or
in a stage it starts as a process of its own (tests/conftest.py's guard)."""

import subprocess
import sys

import pytest
from conftest import REAL_VLLM, REFUSED_VLLM_EXIT


def test_a_child_process_outside_the_vllm_tier_is_refused_vllm_serve():
    # as a stage run by `eagle-jobs capture` finds and starts vLLM (vllm_server.executable, then `serve`)
    child = ("import subprocess, sys; from eagle_jobs.vllm_server import executable; "
             "sys.exit(subprocess.run([executable('vllm'), 'serve', 'some/model']).returncode)")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == REFUSED_VLLM_EXIT, r.stderr
    assert "test_a_child_process_outside_the_vllm_tier_is_refused_vllm_serve: mark it @pytest.mark.vllm" in r.stderr


def test_this_process_outside_the_vllm_tier_is_refused_vllm_serve():
    from eagle_jobs.vllm_server import executable

    for exe in [executable("vllm"), *REAL_VLLM]:
        with pytest.raises(AssertionError, match="starts real vLLM: mark it @pytest.mark.vllm"):
            subprocess.Popen([exe, "serve", "some/model"])


def test_make_test_keeps_our_module_order_which_xdist_would_reorder_by_test_count(pytester):
    """pytest-xdist's loadfile scheduler sorts its units by their number of tests unless told not to
    (xdist/plugin.py: --loadscope-reorder, default True; xdist/scheduler/loadscope.py, `schedule`), which
    would undo tests/conftest.py's costliest-first order: `make test` and `make test-fast` turn it off."""
    from pathlib import Path

    # command lines parsed as pytest parses them, with the plugins it loads (pytest-xdist among them)
    assert pytester.parseconfig().getoption("loadscopereorder") is True
    assert pytester.parseconfig("--no-loadscope-reorder").getoption("loadscopereorder") is False
    make = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    lines = [ln for ln in make.replace("\\\n", " ").splitlines() if "--dist loadfile" in ln]
    assert len(lines) == 2 and all("--no-loadscope-reorder" in ln for ln in lines), lines


def test_xdist_cannot_group_by_rewriting_a_node_id_here(request):
    """Why not `--dist loadgroup`: pytest-xdist 3.8 groups a test by `item._nodeid = f"{nodeid}@{group}"`
    (xdist/remote.py, WorkerInteractor.pytest_collection_modifyitems); pytest 9.2's `Node.nodeid` returns
    `str(self._id)` (_pytest/nodes.py), so the suffix never reaches the scheduler and groups split."""
    item = request.node
    before = item.nodeid
    item._nodeid = f"{before}@group"
    assert item.nodeid == before  # had this changed, loadgroup could keep a module-scoped fixture on one worker


def test_a_dependency_resolution_is_in_the_index_tier_without_anyone_marking_it():
    """tests/conftest.py reads `pip install --dry-run` from a test's source: the four image resolutions
    carry no marker of their own, and still leave `make test-fast`."""
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    assert "mark.index" not in (tests / "test_images.py").read_text()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "index",
                        str(tests / "test_images.py")], capture_output=True, text=True, timeout=300, cwd=tests.parent)
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert r.returncode == 0 and len(ids) == 4, r.stdout[-2000:]
    assert all("resolve" in i for i in ids), ids
