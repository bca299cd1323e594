"""benchmarks/gpu_check.py at its tiny shape on CPU: the script a GPU session runs must not rot."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


@pytest.mark.train  # gpu_check.train_arm trains, outside what conftest's marker inference reads
def test_gpu_check_script_runs_at_tiny_shape_on_cpu(tmp_path):
    # --num-workers 0: each DataLoader worker is a spawned process that imports speculators (some 8 CPU-s),
    # and each arm's train and validation loaders start their own; the torchrun test below keeps the
    # script's default of 2, the path a GPU session takes.
    rs = _gpu_check().main(["--shape", "tiny", "--steps", "4", "--seq-len", "256", "--samples", "6",
                            "--optimizers", "muon,adamw", "--num-workers", "0", "--out", str(tmp_path)])
    for optimizer in ("muon", "adamw"):  # two arms on the one extraction, each exported and inspected
        r = rs[optimizer]
        assert (r["attention"], r["loss"], r["device"], r["world_size"]) == ("sdpa", "eager", "cpu", 1)
        assert r["optimizer"] == optimizer and r["steps"] == 4 and r["tokens_per_s"] > 0 and r["inspect_ok"]
        assert r["num_workers"] == 0
    assert rs["step_ratio"]["muon/adamw"] > 0
    assert (tmp_path / "gpu_check.json").is_file()


@pytest.mark.train
def test_gpu_check_through_torchrun_on_cpu(tmp_path):
    r = _gpu_check().main(["--shape", "tiny", "--ranks", "1", "--fsdp", "--steps", "3", "--seq-len", "256",
                           "--samples", "5", "--out", str(tmp_path)])["muon"]
    assert r["world_size"] == 1 and r["fsdp"] and r["steps"] == 3 and r["inspect_ok"] and r["num_workers"] == 2
    assert (tmp_path / "gpu_check-ranks1-fsdp.json").is_file()


def test_gpu_bundle_pins_what_make_venv_installs():
    """benchmarks/gpu-requirements.txt carries our versions to the device, not some other ones."""
    import importlib.metadata

    pins = [line.split("==") for line in (REPO / "benchmarks/gpu-requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert len(pins) >= 10 and ["speculators", "0.9.0"] in pins
    assert {name: importlib.metadata.version(name) for name, _ in pins} == dict(pins)


def test_gpu_bundle_pins_are_the_locked_versions():
    """make venv installs through requirements/constraints.txt; the GPU bundle must name the same versions,
    or a PyPI release between two installs splits them (a CI run once resolved openai 3.60.0 against 3.57.0)."""
    def pins(path):
        return {name.lower().replace("_", "-"): version for name, version in
                (line.split("==") for line in (REPO / path).read_text().splitlines()
                 if line and not line.startswith("#"))}

    locked, bundle = pins("requirements/constraints.txt"), pins("benchmarks/gpu-requirements.txt")
    assert {name: locked.get(name) for name in bundle} == bundle
