"""The package's import graph has no circle (lazy imports inside functions count: they are still
dependencies), and the stages are peers: none imports another (docs/ARCHITECTURE.md). No function in the
package is over 80 lines."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "eagle_jobs"
STAGES = {"capture", "extract", "train", "evaluate"}


def import_graph(collapse: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports. With collapse, a subpackage (cluster/) is one node."""
    def name(dotted: str) -> str:
        return dotted.split(".")[0] if collapse else dotted

    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        me = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle_jobs"):
                mod = node.module.removeprefix("eagle_jobs").lstrip(".")
                deps |= {mod} if mod else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.removeprefix("eagle_jobs.") for a in node.names if a.name.startswith("eagle_jobs.")}
        graph.setdefault(name(me), set()).update({name(d) for d in deps} - {name(me)})
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
    assert {"verifier", "weights", "train", "cli", "cluster"} <= set(graph)  # the walk sees the package
    assert cycles(graph) == []
    modules = import_graph(collapse=False)  # inside a subpackage too: its __init__ imports its modules
    assert {"cluster", "cluster.follow", "cluster.explain", "cluster.api"} <= set(modules)
    assert "cluster.explain" in modules["cluster.follow"]
    assert "evaluate.sets" in modules["evaluate.run"]  # the evaluate stage is a package of modules too
    assert {"train.launch", "train.checkpoints", "train.data"} <= modules["train.run"]  # and so is train
    assert cycles(modules) == []


def test_the_circle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_stages_are_peers():
    graph = import_graph()
    assert {s: graph[s] & STAGES for s in STAGES} == {s: set() for s in STAGES}


MAX_FUNCTION_LINES = 80


def long_functions(source: str) -> list[tuple[str, int]]:
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_over_80_lines():
    """A stage reads as its steps, each a named function (issue 23 item 2): held for the whole package."""
    found = {path.relative_to(SRC).as_posix(): long for path in SRC.rglob("*.py")
             if (long := long_functions(path.read_text()))}
    assert found == {}


def test_the_length_check_finds_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions("def g():\n    pass\n") == []
