"""The package's import graph has no circle (lazy imports inside functions count: they are still
dependencies), and the stages are peers: none imports another (docs/ARCHITECTURE.md)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "eagle_jobs"
STAGES = {"capture", "extract", "train", "evaluate"}


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in SRC.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle_jobs"):
                mod = node.module.removeprefix("eagle_jobs").lstrip(".")
                deps |= {mod} if mod else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("eagle_jobs.")}
        graph[path.stem] = {d.split(".")[0] for d in deps} - {path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(n, path):
        state[n] = "open"
        for d in sorted(graph.get(n, ())):
            if state.get(d) == "open":
                found.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert {"verifier", "weights", "train", "cli"} <= set(graph)  # the walk sees the package
    assert cycles(graph) == []


def test_the_circle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_stages_are_peers():
    graph = import_graph()
    assert {s: graph[s] & STAGES for s in STAGES} == {s: set() for s in STAGES}
