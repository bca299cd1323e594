"""`eagle-jobs plan --scale` (issue 22 item 4): anchor-scale runs priced per data mode, from the recipe's
`plan:` rates, with docs/OPERATIONS.md's table equal to the command's output."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import kustomize

from eagle_jobs.hsformat import bytes_per_token
from eagle_jobs.plan import make_plan
from eagle_jobs.plan_scale import SCALE_MODES, parse_scales, price_mode, scale_basis, scale_markdown, scale_table
from eagle_jobs.recipe_file import load_recipe

REPO = Path(__file__).resolve().parents[1]
KIMI = REPO / "jobs/kimi-k2.5.yaml"
SCALES = [10_000, 100_000, 600_000, 1_000_000]  # 600 k: the recipe's own size (prompts.limit)
DOC_START, DOC_END = "<!-- eagle-jobs plan --recipe jobs/kimi-k2.5.yaml --scale 10000,100000,600000,1000000 -->", \
    "<!-- end of plan --scale -->"


@pytest.fixture(scope="module")
def kimi():
    """The Kimi recipe on a fixed basis for the arithmetic below (bf16 states, 10 epochs, no window of its
    own), so the checks do not move with the recipe's sizing; the doc and comment tests read it as it is."""
    r = _with(load_recipe(KIMI), extract={"storage_dtype": "bfloat16"}, train={"epochs": 10},
              store={"window_bytes": None})
    return r, scale_basis(r, make_plan(r))  # make_plan imports transformers: once per module


def _rows(kimi, recipe=None, scales=SCALES) -> dict[tuple[int, str], dict]:
    r, b = kimi
    if recipe is not None:
        b = scale_basis(recipe, make_plan(recipe))
    return {(n, m): price_mode(b, n, m) for n in scales for m in SCALE_MODES}


def _with(recipe, **sections):
    return recipe.model_copy(update={k: getattr(recipe, k).model_copy(update=v) for k, v in sections.items()})


def test_bytes_are_tokens_times_bytes_per_token(kimi):
    r, b = kimi
    assert (b.bytes_per_token["bfloat16"] == bytes_per_token(len(r.aux_layer_ids) + 1, 7168, "bfloat16")
            == 4 * 7168 * 2 + 9)
    for (n, _mode), row in _rows(kimi).items():
        assert row["tokens"] == n * 2560  # the kimi recipe's bound: 512 prompt + 2,048 answer tokens
        assert row["corpus_bytes"] == row["tokens"] * b.bytes_per_token["bfloat16"]
        assert row["traffic_bytes"] == row["written_bytes"] + row["read_bytes"]


def test_stored_and_streaming_keep_the_corpus_re_extract_keeps_a_window(kimi):
    r, b = kimi
    window_plus_shards = b.window_bytes + r.plan.extract_nodes * r.extract.shard_bytes
    for (_n, mode), row in _rows(kimi).items():
        corpus, ep = row["corpus_bytes"], r.train.epochs
        if mode in ("stored", "streaming"):
            assert row["peak_store_bytes"] == row["written_bytes"] == corpus
            assert row["read_bytes"] == ep * corpus  # far above local_stage_bytes: every epoch reads the store
        else:
            assert row["peak_store_bytes"] <= window_plus_shards < corpus
            assert row["written_bytes"] == row["read_bytes"] == ep * corpus


def test_a_corpus_below_the_window_peaks_at_itself_and_one_staged_locally_is_read_once(kimi):
    r, _ = kimi
    small = _with(r, plan={"stream_window_bytes": 10 * 1024**4})  # 10 TiB: more than 10 k conversations' 1.3 TiB
    rows = _rows(kimi, small, [1_000, 10_000, 100_000])
    assert rows[10_000, "re-extract"]["peak_store_bytes"] == rows[10_000, "re-extract"]["corpus_bytes"]
    assert rows[100_000, "re-extract"]["peak_store_bytes"] == 10 * 1024**4 + 4 * r.extract.shard_bytes
    staged = _with(r, train={"local_stage_bytes": 2 * 1024**4})
    one = _rows(kimi, staged, [10_000])[10_000, "stored"]
    assert one["read_bytes"] == one["corpus_bytes"]  # staged on local disk, then every epoch reads it there


def test_gpu_hours_scale_linearly_with_conversations(kimi):
    rows = _rows(kimi)
    for mode in SCALE_MODES:
        base = rows[10_000, mode]
        for n in SCALES[1:]:
            k = n / 10_000
            for stage, h in rows[n, mode]["gpu_hours"].items():
                # stored is exact; streaming adds the first shard's lead, a constant of seconds
                assert h == pytest.approx(k * base["gpu_hours"][stage], rel=1e-12 if mode == "stored" else 1e-3)
            for key in ("corpus_bytes", "written_bytes", "traffic_bytes"):
                assert rows[n, mode][key] == pytest.approx(k * base[key], rel=1e-12)


def test_re_extract_computes_every_epoch_prefill_only(kimi):
    r, _ = kimi
    tp, ep = r.plan, r.train.epochs
    for n in SCALES:
        rows = _rows(kimi)
        tokens, corpus = rows[n, "stored"]["tokens"], rows[n, "stored"]["corpus_bytes"]
        one_pass = (tokens / tp.extract_tokens_per_s + corpus / tp.store_bytes_per_s) * tp.gpus_per_node / 3600
        assert rows[n, "stored"]["gpu_hours"]["extract"] == pytest.approx(one_pass)
        assert rows[n, "streaming"]["extract_busy_gpu_hours"] == pytest.approx(one_pass)
        assert rows[n, "re-extract"]["extract_busy_gpu_hours"] == pytest.approx(ep * one_pass)
        # no generation again: capture is the same in every mode
        assert len({rows[n, m]["gpu_hours"]["capture"] for m in SCALE_MODES}) == 1
        # booked covers busy; the kimi rates leave extraction waiting on a store-bound trainer
        assert rows[n, "re-extract"]["gpu_hours"]["extract"] > rows[n, "re-extract"]["extract_busy_gpu_hours"]


def test_training_is_store_bound_at_the_stated_rates_and_compute_bound_on_a_fast_store(kimi):
    r, _ = kimi
    slow = _rows(kimi)[10_000, "stored"]
    assert slow["train_read_bound"]
    fast = _with(r, plan={"store_bytes_per_s": 50e9})
    row = _rows(kimi, fast, [10_000])[10_000, "stored"]
    assert not row["train_read_bound"]
    # 10 k samples x 10 epochs at 0.5 samples/s per GPU, 8 GPUs booked
    assert row["gpu_hours"]["train"] == pytest.approx(10_000 * 10 / 0.5 / 3600)
    assert slow["gpu_hours"]["train"] > row["gpu_hours"]["train"]


def test_streaming_overlaps_extraction_with_the_first_epoch(kimi):
    r, _ = kimi
    for n in SCALES:
        rows = _rows(kimi)
        stored, streaming = rows[n, "stored"], rows[n, "streaming"]
        extract_wall = stored["gpu_hours"]["extract"] * 3600 / (r.plan.gpus_per_node * r.plan.extract_nodes)
        assert streaming["wall_s"] == pytest.approx(stored["wall_s"] - extract_wall, rel=1e-4)
        assert streaming["total_gpu_hours"] == pytest.approx(stored["total_gpu_hours"], rel=1e-4)
    # an extraction slower than an epoch holds training back in the first epoch only
    slow = _with(r, plan={"extract_tokens_per_s": 200.0})
    rows = _rows(kimi, slow, [10_000])
    st, sm = rows[10_000, "stored"], rows[10_000, "streaming"]
    epoch_gpu_h = st["gpu_hours"]["train"] / r.train.epochs  # every epoch of stored training
    extract_wall_as_train_gpu_h = st["gpu_hours"]["extract"] / r.plan.extract_nodes  # 8 of its 32 GPUs
    assert extract_wall_as_train_gpu_h > epoch_gpu_h
    assert sm["gpu_hours"]["train"] == pytest.approx(extract_wall_as_train_gpu_h + (r.train.epochs - 1) * epoch_gpu_h)
    # re-extract: every epoch waits on a whole extraction pass, and the extraction pods are busy throughout
    assert rows[10_000, "re-extract"]["gpu_hours"]["extract"] == pytest.approx(10 * sm["gpu_hours"]["extract"])
    assert rows[10_000, "re-extract"]["extract_busy_gpu_hours"] == pytest.approx(10 * sm["gpu_hours"]["extract"])


def test_every_number_says_where_it_comes_from(kimi):
    r, _ = kimi
    sources = scale_table(r, [10_000])["sources"]
    for name in type(r.plan).model_fields:
        src = sources[f"plan.{name}"]["from"]
        assert src.startswith("default: ") and len(src) > 20, (name, src)
    assert "the seed run" in sources["plan.train_samples_per_s_per_gpu"]["from"]
    # a source a reader of this repository can find: no path outside it
    assert not any("../" in x["from"] for x in sources.values())
    assert sources["window_bytes"]["value"] == r.plan.stream_window_bytes


def test_a_plan_section_in_a_recipe_is_named_as_the_source(tmp_path):
    raw = yaml.safe_load(KIMI.read_text())
    raw["plan"] = {"extract_nodes": 2, "capture_tokens_per_s": 5000}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    r = load_recipe(tmp_path / "r.yaml")
    src = scale_table(r, [10_000])["sources"]
    assert src["plan.extract_nodes"] == {"value": 2, "from": "recipe kimi-k2.5"}
    assert src["plan.capture_tokens_per_s"]["from"] == "recipe kimi-k2.5"
    assert src["plan.extract_tokens_per_s"]["from"].startswith("default: ")


def test_parse_scales():
    assert parse_scales("10000,100000,1000000") == parse_scales("10k, 100K,1M") == [10_000, 100_000, 1_000_000]
    for bad in ("", "10x", "-5", "0", "1.5M"):
        with pytest.raises(ValueError, match="conversation count"):
            parse_scales(bad)


def test_cli_refuses_a_bad_scale_in_one_line():
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "plan", "--recipe", str(KIMI), "--scale", "10k,lots"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "'lots' is not a conversation count" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def cli_table() -> str:
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "plan", "--recipe", str(KIMI), "--scale",
                        ",".join(map(str, SCALES))], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_operations_doc_carries_the_commands_table(cli_table):
    doc = (REPO / "docs/OPERATIONS.md").read_text()
    assert "## Anchor-scale runs" in doc
    block = doc[doc.index(DOC_START) + len(DOC_START):doc.index(DOC_END)]
    assert block.strip("\n") == cli_table.strip("\n"), "regenerate: " + DOC_START[5:-4]


def test_json_form_is_the_table(kimi):
    from typer.testing import CliRunner

    from eagle_jobs.cli import app

    out = CliRunner().invoke(app, ["plan", "--recipe", str(KIMI), "--scale", "10k,1M", "--json"])
    assert out.exit_code == 0, out.output
    table = json.loads(out.stdout)
    assert [(row["conversations"], row["mode"]) for row in table["rows"]] == \
        [(n, m) for n in (10_000, 1_000_000) for m in SCALE_MODES]
    assert scale_markdown(table) == scale_markdown(scale_table(load_recipe(KIMI), [10_000, 1_000_000]))


def test_auto_storage_prices_each_corpus_in_the_dtype_extraction_would_store(kimi):
    """extract.storage_dtype auto: a corpus above extract.fp8_above_bytes in bf16 is priced (and stored) as
    fp8, a smaller one as bf16; a recipe that names a dtype is priced in it at every size."""
    r = load_recipe(KIMI)
    assert r.extract.storage_dtype == "auto"
    b = scale_basis(r, make_plan(r))
    small, large = price_mode(b, 10, "stored"), price_mode(b, 10_000, "stored")
    assert small["corpus_bytes"] < r.extract.fp8_above_bytes < large["corpus_bytes"]
    assert (small["storage"], large["storage"]) == ("bfloat16", "fp8")
    assert large["corpus_bytes"] == large["tokens"] * bytes_per_token(4, 7168, "fp8")
    assert {row["storage"] for row in _rows(kimi).values()} == {"bfloat16"}  # the fixture names bfloat16


def test_kimi_recipe_comment_quotes_the_table(cli_table):
    """jobs/kimi-k2.5.yaml says what its own data size costs in each mode: its figures are the table's rows
    at its prompts.limit, and it runs the mode it names."""
    r = load_recipe(KIMI)
    comment = "\n".join(line for line in KIMI.read_text().splitlines() if line.startswith("#"))
    size = f"| {r.prompts.limit:,} |"
    rows = {line.split(" | ")[1]: line for line in cli_table.splitlines() if line.startswith(size)}
    quoted = re.findall(r"#   ([\w-]+): ([\d,]+) GPU-hours, ([\d.]+ [KMGTP]iB) peak, ([\d.]+) days", comment)
    assert {q[0] for q in quoted} == set(SCALE_MODES), comment
    for mode, hours, peak, days in quoted:
        cells = rows[mode].split(" | ")  # "| 600,000", mode, states, capture, extract, train, total, peak, ...
        assert (hours, peak, f"{days} d |") == (cells[6], cells[7], cells[10]), (mode, rows[mode])
    assert (r.train.source, r.train.later_epochs) == ("stream", "keep")  # "streaming" in the table


@pytest.mark.k8s
def test_node_defaults_are_the_full_overlays(kimi):
    """plan.capture_nodes, extract_nodes and gpus_per_node describe k8s/overlays/full as rendered."""
    r, _ = kimi
    js = next(d for d in kustomize(REPO / "k8s/overlays/full") if d["kind"] == "JobSet")
    jobs = {j["name"]: j["template"]["spec"] for j in js["spec"]["replicatedJobs"]}

    def gpus(spec):
        pod = spec["template"]["spec"]
        return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
                   for c in pod["containers"] + pod.get("initContainers", []))

    for stage, nodes in (("capture", r.plan.capture_nodes), ("extract", r.plan.extract_nodes),
                         ("train", r.train.nnodes)):
        assert jobs[stage]["parallelism"] == jobs[stage]["completions"] == nodes, stage
        assert gpus(jobs[stage]) == r.plan.gpus_per_node, stage
