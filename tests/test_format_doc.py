"""docs/FORMAT.md stays true: its tables name exactly what the stages write."""

import re
from pathlib import Path

from eagle_jobs.capture import run_capture
from eagle_jobs.committed import extraction_info, read_rows
from eagle_jobs.extract import run_extract
from eagle_jobs.records import Row, SampleEntry, Skipped, TensorEntry
from eagle_jobs.store import Store

DOC = (Path(__file__).resolve().parents[1] / "docs/FORMAT.md").read_text()


def _table_names(after: str) -> set[str]:
    block = DOC[DOC.index(after):]
    names = []
    for line in block.splitlines()[2:]:
        if not line.startswith("|"):
            if names:
                break
            continue
        cell = line.split("|")[1]
        names += re.findall(r"`([^`]+)`", cell)
    return {n for n in names if not set(n) & {"-", " "}}


def test_capture_row_fields_are_documented(tiny_recipe, tmp_path):
    st = Store.open(f"file://{tmp_path}/s")
    r = tiny_recipe(prompts={"limit": 3})
    run_capture(r, st, "d")
    row = read_rows(st, "d")[0]
    documented = _table_names("`data/<shard>.jsonl`")
    assert set(row) == documented - {"---"}, (set(row) ^ documented)
    assert set(Row.__annotations__) == set(row)  # the type readers get is the documented row


def test_hidden_state_shard_is_as_documented(tiny_recipe, tmp_path):
    st = Store.open(f"file://{tmp_path}/s")
    r = tiny_recipe(prompts={"limit": 3})
    run_capture(r, st, "d")
    run_extract(r, st, "d")
    m = extraction_info(st, "d")["manifests"][0]
    e = m["samples"][0]
    block = DOC[DOC.index("`{row_id, split"):]
    keys = {k.strip() for k in block[2: block.index("tensors:")].split(",") if k.strip()} | {"tensors"}
    assert set(e) == keys, set(e) ^ keys
    assert set(SampleEntry.__annotations__) == keys  # the type train and reuse read is the documented entry
    assert set(TensorEntry.__annotations__) == set(e["tensors"]["hidden_states"]) == {"dtype", "shape", "offset"}
    assert "`[{row_id, reason}]`" in DOC and set(Skipped.__annotations__) == {"row_id", "reason"}
    assert set(e["tensors"]) == {"hidden_states", "token_ids", "loss_mask"}
    for name in ("{i}.hidden_states", "{i}.scales", "{i}.token_ids", "{i}.loss_mask"):
        assert f"`{name}`" in DOC
    for key in ("format", "storage", "layer_ids", "hidden_size", "tokens", "verifier", "settings_digest", "skipped"):
        assert key in m and f"`{key}`" in DOC


def test_stages_are_peers():
    """No stage imports another; what they share of each other's output is in committed.py (docs/ARCHITECTURE.md)."""
    import ast

    stages = {"capture", "extract", "train", "evaluate"}
    src = Path(__file__).resolve().parents[1] / "src/eagle_jobs"
    for name in stages | {"committed", "vllm_server", "vllm_cpu"}:
        package = src / name  # a stage that is a package (evaluate/): every module of it
        paths = sorted(package.rglob("*.py")) if package.is_dir() else [src / f"{name}.py"]
        imported = set()
        for node in (n for path in paths for n in ast.walk(ast.parse(path.read_text()))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle_jobs"):
                # eagle_jobs.evaluate.sets is the evaluate stage
                imported.add(node.module.removeprefix("eagle_jobs").strip(".").split(".")[0])
                imported.update(a.name for a in node.names if node.module == "eagle_jobs")
        assert not (imported & (stages - {name})), f"{name} imports {sorted(imported & stages)}"


def _section(title: str) -> str:
    start = DOC.index(f"\n## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


def test_report_records_are_documented_field_by_field():
    """Every field of the typed eval and compare reports is named in its FORMAT.md section, and each
    section's typed records are the ones evaluate and compare build (their annotations)."""
    from eagle_jobs.records import (
        ArmSetResult,
        CompareArm,
        CompareReport,
        EvalReport,
        LevelChoice,
        PositionBucket,
        PromptSetResult,
        ServingAdvice,
        ServingRange,
        SpeedLevel,
        SpeedTable,
        TimedPass,
    )

    for section, records in {"eval": [EvalReport, PromptSetResult, SpeedTable, SpeedLevel, TimedPass, PositionBucket,
                                      ServingAdvice, LevelChoice, ServingRange],
                             "variants and compare": [CompareReport, CompareArm, ArmSetResult]}.items():
        spans = re.findall(r"`([^`]+)`", _section(section))  # `field`, or `{field, other: {...}}` over lines
        named = {word for span in spans for word in re.findall(r"[a-z_][a-z_0-9]*", span)}
        for record in records:
            missing = set(record.__annotations__) - named
            assert not missing, f"docs/FORMAT.md '{section}' does not name {record.__name__}'s {sorted(missing)}"
