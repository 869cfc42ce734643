"""Docs that name the code stay true: every backticked reference to a source file, a line, a
module or a name in docs/, the README and the product code's own docstrings and comments
resolves in the tree as it is.

What counts as a reference (inside backticks):
- a path ending in `.py`, from the repository root or from `flexmarl_core/` (`stages/train.py`),
  or, in code, from the file's own folder; with `:N` the file has a line N, with `:name` it
  defines `name`;
- a path followed by a backticked name (`` `runtime/worker.py` `checkpoint_due` ``): the file
  defines it (a function, class, method or assignment at any depth);
- a dotted name rooted in a product package (`flexmarl_core.driver.run.train`): the longest
  prefix that is a module exists and defines the rest.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PACKAGES = ("flexmarl_core", "storage", "tasks", "flows", "flexmarl", "bench", "tests")
CODE = sorted(p for pkg in PACKAGES[:5] for p in (REPO / pkg).rglob("*.py"))
#: a placeholder in prose, not a file
PLACEHOLDERS = ("path/to/", "module:function", "file.py:function", "my_rewards/")

FILE_REF = re.compile(r"`([\w./-]+\.py)(?::([\w]+))?`(?: `([A-Za-z_][\w.]*)(?:\(\))?`)?")
DOTTED_REF = re.compile(r"`((?:" + "|".join(PACKAGES[:5]) + r")(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """Every name `path` defines: functions, classes and methods (also as `Class.name`),
    assignments at any depth (attributes of `self` too)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(child.name)
                if owner:
                    names.add(f"{owner}.{child.name}")
                visit(child, child.name if isinstance(child, ast.ClassDef) else owner)
                continue
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, ast.AnnAssign | ast.AugAssign):
                targets = [child.target]
            for t in targets:
                for n in ast.walk(t):
                    name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
                    if name:
                        names.add(name)
                        if owner:
                            names.add(f"{owner}.{name}")
            if isinstance(child, ast.ImportFrom | ast.Import):  # re-exported names
                names.update((a.asname or a.name).split(".")[0] for a in child.names)
            visit(child, owner)

    visit(tree, None)
    return frozenset(names)


def _file(ref: str, here: Path | None = None) -> Path | None:
    for base in (REPO, REPO / "flexmarl_core", *([here] if here else [])):
        if (base / ref).is_file():
            return base / ref
    return None


def _check_file_ref(ref: str, suffix: str | None, name: str | None, here: Path | None = None) -> str | None:
    path = _file(ref, here)
    if path is None:
        return f"`{ref}`: no such file (from the repository root or flexmarl_core/)"
    if suffix and suffix.isdigit():
        if int(suffix) > len(path.read_text().splitlines()):
            return f"`{ref}:{suffix}`: the file has fewer lines"
    elif suffix and suffix not in _defined(path):
        return f"`{ref}:{suffix}`: {suffix!r} is not defined there"
    if name and name.split(".")[-1] not in _defined(path) and name not in _defined(path):
        return f"`{ref}` `{name}`: {name!r} is not defined there"
    return None


def _check_dotted(ref: str) -> str | None:
    parts = ref.split(".")
    for k in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:k])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[k:]
            if not rest:
                return None
            names = _defined(module)
            if rest[0] in names and (len(rest) == 1 or ".".join(rest[:2]) in names or rest[-1] in names):
                return None
            return f"`{ref}`: {'.'.join(rest)!r} is not defined in {module.relative_to(REPO)}"
    return f"`{ref}`: no such module"


def _problems(page: Path) -> list[str]:
    text = page.read_text()
    out = []
    for m in FILE_REF.finditer(text):
        ref, suffix, name = m.groups()
        if any(p in m.group(0) for p in PLACEHOLDERS) or ref.startswith(("http", "/", "~")):
            continue
        here = page.parent if page.suffix == ".py" else None
        if (err := _check_file_ref(ref, suffix, name, here)) is not None:
            out.append(err)
    for m in DOTTED_REF.finditer(text):
        if (err := _check_dotted(m.group(1))) is not None:
            out.append(err)
    return out


def test_every_code_reference_in_the_docs_resolves():
    bad = [f"{page.relative_to(REPO)}: {p}" for page in PAGES for p in _problems(page)]
    assert not bad, f"{len(bad)} references in the docs name nothing in the code:\n" + "\n".join(bad)


def test_every_code_reference_in_the_code_resolves():
    bad = [f"{path.relative_to(REPO)}: {p}" for path in CODE for p in _problems(path)]
    assert not bad, f"{len(bad)} references in docstrings and comments name nothing:\n" + "\n".join(bad)


def test_the_checker_catches_what_it_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`stages/train.py` `step`, `runtime/worker.py:checkpoint_due`, `flexmarl_core.driver.run.train`, "
                    "`stages/train.py:3`, `path/to/file.py:function`\n"
                    "`nowhere/gone.py`, `stages/train.py` `no_such_name`, `flexmarl_core.driver.run.nothing`, "
                    "`stages/train.py:99999`, `flexmarl_core.gone.module`\n")
    found = _problems(page)
    assert len(found) == 5, found
    assert all(any(s in p for p in found) for s in ("gone.py", "no_such_name", "nothing", "99999", "gone.module"))
