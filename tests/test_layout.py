"""One content hash and one place for stage names and their store directories (eagle_jobs.layout)."""

import ast
import re
from pathlib import Path

from eagle_jobs.layout import STAGES, StageName, content_hash, epochs_dir, eval_dir, train_dir

SRC = Path(__file__).resolve().parents[1] / "src" / "eagle_jobs"


def test_the_content_hash_encoding_is_pinned():
    # Stored as reuse keys, recipe digests and prompt-set identities (docs/FORMAT.md): these values
    # were computed by every copy of the hash before they became one function; a change in
    # encoding (separators, ensure_ascii, key order) would silently stop reuse from matching.
    obj = {"b": [1, 2], "a": "é"}
    assert content_hash(obj) == "7d1f522b641be35c268b61f8a47f027d9ca80c1da1ce989ab8d0c3b88481a8cb"
    assert content_hash(obj, 16) == content_hash(obj)[:16]
    assert content_hash([1, 2, 3]) == "a36b1f2c3f84522dd1005145646617d7054c0851e97c72a039c0bdfac9fa07f3"


def test_no_module_hashes_json_on_its_own():
    offenders = [p.name for p in SRC.rglob("*.py") if p.name != "layout.py"
                 and re.search(r"sha256\(\s*json\.dumps", p.read_text())]
    assert offenders == []


def test_stage_directories():
    assert [s.value for s in STAGES] == ["capture", "extract", "train", "evaluate"]
    assert [s.dir for s in STAGES] == ["capture", "extract", "train", "eval"]
    assert StageName("evaluate") == "evaluate" and f"{StageName.TRAIN}" == "train"
    assert (train_dir(), eval_dir(), epochs_dir()) == ("train", "eval", "epochs")
    assert (train_dir("lk"), eval_dir("lk"), epochs_dir("lk")) == (
        "variants/lk/train", "variants/lk/eval", "variants/lk/epochs")


def test_no_module_spells_a_stage_directory():
    """Stage(store, run, "<literal>") outside layout would be a second copy of the layout."""
    found = []
    for p in SRC.rglob("*.py"):  # subpackages (evaluate/, cluster/) too
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Stage" and len(node.args) >= 3
                    and isinstance(node.args[2], ast.Constant)):
                found.append(f"{p.name}:{node.lineno}")
    assert found == []
