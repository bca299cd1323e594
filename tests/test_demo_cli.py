"""The embedded default through the CLI: real SmolLM2-135M-Instruct (from PyPI's GGUF) into a real S3 API."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_cli_capture_demo_recipe_into_s3(bucket, tmp_path):
    raw = yaml.safe_load((REPO / "jobs/demo-transformers.yaml").read_text())
    raw["prompts"]["limit"] = 6
    raw["sampling"]["max_new_tokens"] = 12
    recipe = tmp_path / "demo-small.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    uri = f"s3://{bucket}/runs"
    r = subprocess.run([sys.executable, "-m", "eagle_jobs.cli", "capture", "--recipe", str(recipe), "--store", uri,
                        "--run-id", "cli"], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    from eagle_jobs.committed import read_rows
    from eagle_jobs.prompts import read_prompts
    from eagle_jobs.recipe_file import load_recipe
    from eagle_jobs.store import Store
    from eagle_jobs.verifier import load_tokenizer

    rows = read_rows(Store.open(uri), "cli")
    assert len(rows) >= 6
    tok = load_tokenizer(load_recipe(recipe).verifier)
    prompts = {c.index: list(c.messages) for c in read_prompts(load_recipe(recipe).prompts)[0]}
    for row in rows:
        if row["turn"]:
            continue
        msgs = [m for m in prompts[row["prompt_index"]] if m["role"] != "assistant"][:1]
        templated = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        n = row["num_prompt_tokens"]
        text = tok.decode(row["input_ids"])
        assert tok.decode(row["input_ids"][:n]) == templated  # the chat-templated prompt...
        assert text == templated + tok.decode(row["input_ids"][n:])  # ...plus the generated answer
        assert row["content"] and row["content"].split()[0] in text[len(templated):]
