"""No import cycles among the product packages, function-level imports included.

Every import statement of every module of `flexmarl_core`, `storage`, `tasks`, `flows` and
`flexmarl` is an edge to the module it names (imports under `if TYPE_CHECKING:` are left out:
they never run). A cycle is a set of modules that reach each other along these edges; a
function-level import that closes one hides the cycle from import time but not from the
reader, so it counts the same. Importing `pkg.sub` from outside `pkg` also runs
`pkg/__init__.py` first, so it is an edge to `pkg` too: a cycle through a package's
re-exports fails at import time as surely as a direct one.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flexmarl_core", "storage", "tasks", "flows", "flexmarl")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of everything `module` imports, at any depth but TYPE_CHECKING."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:  # the `else:` of a TYPE_CHECKING test does run
                    visit(ast.Module(body=[sub], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - child.level + 1]
                    prefix = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    prefix = child.module or ""
                # `from pkg import name`: the submodule `pkg.name` if there is one, else `pkg`
                out.extend((f"{prefix}.{a.name}", child.lineno) for a in child.names)
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: dict[str, int] = {}
        for name, line in _imported_names(tree, mod, path.name == "__init__.py"):
            parts = name.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                           if ".".join(parts[:k]) in mods), None)
            if target is None:
                continue
            # the packages above the target that `mod` is not inside run their __init__ first
            parents = [".".join(target.split(".")[:k]) for k in range(1, target.count(".") + 1)]
            for t in [*parents, target]:
                if t in mods and t != mod and not (mod == t or mod.startswith(t + ".")):
                    edges.setdefault(t, line)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _describe(comp: list[str], graph: dict[str, dict[str, int]]) -> str:
    """One shortest cycle through the component's first module, edge by edge with its line."""
    inside, start = set(comp), comp[0]
    came: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in came:
        nxt = []
        for m in frontier:
            for t in graph[m]:
                if t in inside and t not in came:
                    came[t] = m
                    nxt.append(t)
        frontier = nxt
    path, m = [start], came[start]
    while m != start:
        path.append(m)
        m = came[m]
    path.append(start)
    path.reverse()
    hops = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:], strict=False))
    return f"{len(comp)} modules, e.g. {hops} -> {start}"


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert len(graph) > 100
    # storage's own modules import each other relatively (`from .fs import ...`)
    assert "storage.fs" in graph["storage.commit"]
    # `from pkg import submodule` is an edge to the submodule
    assert "flexmarl_core.stages.train" in graph["flexmarl_core.stages"]
    # a submodule from outside its package runs the package's __init__ first; a sibling does not
    assert "flexmarl_core.training" in graph["flexmarl_core.trainers.policy"]
    assert "storage" not in graph["storage.commit"]


def test_cycles_are_found_through_function_level_imports():
    tree = ast.parse("import a.x\n\ndef f():\n    from b import y\n\nif TYPE_CHECKING:\n    import c\n")
    assert [n for n, _ in _imported_names(tree, "m", False)] == ["a.x", "b.y"]
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_every_product_folder_is_a_regular_package():
    """A folder of modules without `__init__.py` imports from a checkout (a namespace package)
    but not from the zip `cluster.upload` ships to workers: zipimport has no namespace
    packages, so the worker fails with `No module named ...` mid-run."""
    missing = sorted(str(d.relative_to(REPO)) for pkg in PACKAGES
                     for d in [REPO / pkg, *(REPO / pkg).rglob("*")]
                     if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
                     and not (d / "__init__.py").exists())
    assert not missing, f"folders of modules without __init__.py: {missing}"
