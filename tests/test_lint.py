"""ruff and mypy keep src/ clean, and ruff tests/, with the configuration in pyproject.toml (part of
`make test-fast`)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean_on_src():
    r = _run(str(BIN / "ruff"), "check", "src")
    assert r.returncode == 0, r.stdout[-4000:]


def test_ruff_is_clean_on_tests():
    r = _run(str(BIN / "ruff"), "check", "tests")
    assert r.returncode == 0, r.stdout[-4000:]


def test_mypy_is_clean_on_src():
    r = _run(str(BIN / "mypy"))  # files and settings: [tool.mypy] in pyproject.toml
    assert r.returncode == 0, r.stdout[-4000:]


def test_the_linters_would_fail_on_a_finding(tmp_path):
    """The checks above can fail: the same tools on a file with a finding each."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x: int) -> str:\n    return x\n")
    assert _run(str(BIN / "ruff"), "check", "--no-cache", str(bad)).returncode == 1
    assert _run(str(BIN / "mypy"), "--no-incremental", str(bad)).returncode == 1
