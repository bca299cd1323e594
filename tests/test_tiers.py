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
