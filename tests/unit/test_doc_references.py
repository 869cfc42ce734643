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
  prefix that is a module exists and defines the rest;
- a class named from a flexmarl_core module (`orchestrator.loop.Orchestrator`): as if rooted in
  flexmarl_core (a config path such as `cluster.address` names no class, so is left alone);
- a flat module with an underscore and a class (`executor_api.ChainingExecutor`, the layout before
  the subpackages): the module is a product module or an installed one.

Outside backticks (`_bare_problems`), file paths ending in `.py` and dotted names rooted in a
product package must resolve the same way: in the pages all text, in the code its comments and
string literals (docstrings, config field descriptions, messages).

And the figures the README's results table and docs/results/index.md quote are in the
bench/results JSON their rows' pages cite (below, `_unbacked_figures`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import json
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PACKAGES = ("flexmarl_core", "storage", "tasks", "flows", "flexmarl", "bench", "tests")
CODE = sorted(p for pkg in PACKAGES[:5] for p in (REPO / pkg).rglob("*.py"))
#: a placeholder in prose, not a file
PLACEHOLDERS = ("path/to/", "module:function", "file.py:function", "path.py:function", "my_rewards/")

FILE_REF = re.compile(r"`([\w./-]+\.py)(?::([\w]+))?`(?: `([A-Za-z_][\w.]*)(?:\(\))?`)?")
DOTTED_REF = re.compile(r"`((?:" + "|".join(PACKAGES[:5]) + r")(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
CORE = REPO / "flexmarl_core"
CORE_CHILDREN = sorted({p.stem for p in CORE.glob("*.py") if p.stem != "__init__"}
                       | {p.name for p in CORE.iterdir() if (p / "__init__.py").is_file()})
#: `orchestrator.loop.Orchestrator`: a short dotted name with a class in it
SHORT_CLASS_REF = re.compile(r"`((?:" + "|".join(CORE_CHILDREN) + r")(?:\.[A-Za-z_]\w*)*\.[A-Z]\w*)"
                             r"(?:\(\))?`")
FLAT_MODULE_REF = re.compile(r"`([a-z]\w*_\w*)\.([A-Z]\w*)")
BARE_FILE = re.compile(r"(?<![\w./~`-])([A-Za-z_][\w./-]*\.py)(?::(\w+))?(?![\w/])")
BARE_DOTTED = re.compile(r"(?<![\w./`-])((?:" + "|".join(PACKAGES[:5]) + r")(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
#: a backticked span: within a line on a page, across lines in a docstring (one token: the
#: backticks pair up)
BACKTICKED = {".py": re.compile(r"`[^`]*`"), ".md": re.compile(r"`[^`\n]*`")}
#: a bare dotted name ending in one of these is a file (`storage.md`), not a module
FILE_SUFFIXES = {"md", "py", "json", "jsonl", "yaml", "yml", "toml", "txt", "log", "png", "parquet"}
#: files of other projects that comments name (distributed's spans.py, DeepSpeed's zero_to_fp32.py)
OTHER_PROJECTS = ("spans.py", "zero_to_fp32.py")
#: Bare references known to name nothing, in files being reworked, each (file, reference) with
#: its fix: skipped until fixed there, and an entry that names something or nothing stale any more
#: fails `test_the_known_stale_references_are_still_stale`, so the list empties as they are fixed.
KNOWN_STALE: tuple[tuple[str, str], ...] = ()


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
    for m in SHORT_CLASS_REF.finditer(text):
        if _check_dotted(f"flexmarl_core.{m.group(1)}") is not None:
            out.append(f"`{m.group(1)}`: not a class of flexmarl_core/{m.group(1).split('.')[0]}")
    for m in FLAT_MODULE_REF.finditer(text):
        if (err := _check_flat_module(m.group(1))) is not None:
            out.append(f"`{m.group(0)[1:]}`: {err}")
    return out


@functools.cache
def _check_flat_module(name: str) -> str | None:
    product = any(next((REPO / pkg).rglob(f"{name}.py"), None) for pkg in PACKAGES[:5])
    if product or importlib.util.find_spec(name):
        return None
    return f"no module {name!r} in the product or installed"


def _prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of what `path` says in words: a page's text, a module's comments and
    string literals (names in its code are checked by importing it)."""
    text = path.read_text()
    if path.suffix != ".py":
        return [(1, text)]
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [(t.start[0], t.string) for t in tokens if t.type in kinds]


def _bare_problems(path: Path, known: tuple[tuple[str, str], ...] = KNOWN_STALE) -> list[str]:
    """`file:line: problem` for each file path or product module named outside backticks in
    `path` that names nothing (backticked ones are `_problems`'s), but those in `known`."""
    here = path.parent if path.suffix == ".py" else None
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    skip = {ref for file, ref in known if REPO / file == path}
    out = []
    for first, chunk in _prose(path):
        chunk = BACKTICKED[path.suffix].sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), chunk)
        found: list[tuple[int, str | None]] = []
        for m in BARE_FILE.finditer(chunk):
            ref, suffix = m.groups()
            if (any(p in m.group(0) for p in PLACEHOLDERS) or ref.split("/")[-1] in OTHER_PROJECTS
                    or m.group(0) in skip):
                continue
            found.append((m.start(), _check_file_ref(ref, suffix, None, here)))
        for m in BARE_DOTTED.finditer(chunk):
            if m.group(1).rsplit(".", 1)[-1] not in FILE_SUFFIXES and m.group(1) not in skip:
                found.append((m.start(), _check_dotted(m.group(1))))
        out += [f"{rel}:{first + chunk.count(chr(10), 0, at)}: {err.replace('`', '')}"
                for at, err in found if err is not None]
    return out


def test_every_code_reference_in_the_docs_resolves():
    bad = [f"{page.relative_to(REPO)}: {p}" for page in PAGES for p in _problems(page)]
    assert not bad, f"{len(bad)} references in the docs name nothing in the code:\n" + "\n".join(bad)


def test_every_code_reference_in_the_code_resolves():
    bad = [f"{path.relative_to(REPO)}: {p}" for path in CODE for p in _problems(path)]
    assert not bad, f"{len(bad)} references in docstrings and comments name nothing:\n" + "\n".join(bad)


def test_every_bare_reference_resolves():
    bad = [p for path in (*PAGES, *CODE) for p in _bare_problems(path)]
    assert not bad, f"{len(bad)} file or module names outside backticks name nothing:\n" + "\n".join(bad)


def test_the_known_stale_references_are_still_stale():
    for file, ref in KNOWN_STALE:
        found = _bare_problems(REPO / file, known=())
        assert any(f": {ref}:" in p for p in found), f"KNOWN_STALE: {file} names no stale {ref!r}: drop it"


def test_the_bare_checker_catches_what_it_should(tmp_path):
    good = ('"""See flows/train.py, stages/train.py:step and flexmarl_core.driver.run.train; '
            "storage.md, path/to/x.py and distributed's spans.py are no modules. `gone.py` is "
            '`_problems`\'s."""\n')
    bad = ('# stale: (orchestrator.py), stages/train.py:no_such_name,\n'
           'MSG = "flexmarl_core.gone.module and storage.nothing"\n')
    module = tmp_path / "module.py"
    module.write_text(good + "x = flexmarl_core.gone  # code is not prose\n" + bad)
    found = _bare_problems(module)
    assert [p.split(":")[1] for p in found] == ["3", "3", "4", "4"], found
    assert all(any(s in p for p in found)
               for s in ("orchestrator.py", "no_such_name", "gone.module", "nothing")), found
    page = tmp_path / "page.md"
    page.write_text("see flexmarl_core/training/handles.py and handles.py\n")
    assert len(_bare_problems(page)) == 1


def test_the_checker_catches_what_it_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`stages/train.py` `step`, `runtime/worker.py:checkpoint_due`, `flexmarl_core.driver.run.train`, "
                    "`stages/train.py:3`, `path/to/file.py:function`\n"
                    "`nowhere/gone.py`, `stages/train.py` `no_such_name`, `flexmarl_core.driver.run.nothing`, "
                    "`stages/train.py:99999`, `flexmarl_core.gone.module`\n"
                    "`orchestrator.loop.Orchestrator`, `cluster.address`, `typing_extensions.TypedDict`\n"
                    "`orchestrator.Orchestrator`, `executor_api.ChainingExecutor`\n")
    found = _problems(page)
    assert len(found) == 7, found
    assert all(any(s in p for p in found) for s in ("gone.py", "no_such_name", "nothing", "99999", "gone.module",
                                                    "orchestrator.Orchestrator", "executor_api"))


# --- Figures in the results tables come from the JSON they cite --------------------------------
#
# Each row of the README's results table and of docs/results/index.md links to a docs/results
# page (with an anchor: to that section of it). The JSON files that page (or section) names under
# bench/results/, and their provenance, are the row's record: every decimal figure the row quotes
# (0.93x, +0.047, 0.391, 4.2 ms, ×1.02) must be one of their numbers rounded to the figure's
# precision. Integers (counts: 20 iterations, 3 seeds, 7 of 7) are not checked, nor numbers glued
# to a letter (a 0.5B model, a 1.1M-parameter one). A quoted sign must match; an unquoted figure
# matches a number of either sign. A figure followed by % may also be a fraction times 100.
# Lists longer than SERIES_MAX (per-iteration or per-sample series) are not figures a row quotes.

RESULTS_DIR = REPO / "bench" / "results"
RESULTS_TABLES = ((REPO / "README.md", "## Results"), (REPO / "docs" / "results" / "index.md", None))
SERIES_MAX = 32
#: Rows (by the start of their claim cell, any case) whose figures are being recorded anew and are
#: not checked until then. To be emptied once their records are committed.
FIGURES_NOT_CHECKED: tuple[str, ...] = ()

TABLE_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FIGURE = re.compile(r"(?<![\w.])([+\-−]?)(\d[\d,]*\.\d+)(?![\d.]|[A-Za-wyz])(%?)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$", re.M)
CITED_JSON = re.compile(r"bench/results/([\w.-]+?)\.json")


def _slug(title: str) -> str:
    title = re.sub(r"[`*]", "", title)
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _section(text: str, anchor: str) -> str | None:
    """The part of a page under the heading `anchor` names, down to the next heading of its level
    or above; the whole page without an anchor; None if no heading has that anchor."""
    if not anchor:
        return text
    heads = list(HEADING.finditer(text))
    for i, h in enumerate(heads):
        if _slug(h.group(2)) == anchor:
            end = next((n.start() for n in heads[i + 1:] if len(n.group(1)) <= len(h.group(1))), len(text))
            return text[h.start():end]
    return None


def _json_numbers(value, in_strings: bool) -> list[float]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, str):
        return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", value)] if in_strings else []
    items = list(value.values()) if isinstance(value, dict) else value
    if isinstance(value, list) and len(value) > SERIES_MAX:
        return []
    return [n for item in items for n in _json_numbers(item, in_strings)]


def _table_rows(text: str, heading: str | None) -> list[str]:
    if heading:
        text = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [r for r in text.splitlines() if r.startswith("|") and not set(r) <= set("|-: ")]
    return rows[1:]  # the header


def _matches(sign: str, figure: str, percent: str, numbers: list[float]) -> bool:
    q = float(figure.replace(",", ""))
    half = 0.5 * 10 ** -len(figure.split(".")[1]) + 1e-12
    q = -q if sign in ("-", "−") else q
    for v in numbers:
        for w in ((v, 100 * v) if percent else (v,)):
            if abs((w if sign else abs(w)) - q) <= half:
                return True
    return False


def _unbacked_figures(table: Path, heading: str | None, results: Path = RESULTS_DIR,
                      unchecked: tuple[str, ...] = FIGURES_NOT_CHECKED) -> list[str]:
    """`claim: figure` for each figure of a results table's rows that none of the JSON its row's
    pages cite holds; a row whose links give no JSON is one problem."""
    problems = []
    for row in _table_rows(table.read_text(), heading):
        claim = row.strip("|").split("|")[0].strip()
        if unchecked and claim.lower().startswith(unchecked):
            continue
        names: set[str] = set()
        for target in TABLE_LINK.findall(row):
            path, _, anchor = target.partition("#")
            page = (table.parent / path).resolve()
            text = _section(page.read_text(), anchor) if page.is_file() else None
            if text is None:
                problems.append(f"{claim}: {target} is no page or section")
                continue
            names |= set(CITED_JSON.findall(text))
        numbers = [n for name in sorted(names) if (results / f"{name}.json").is_file()
                   for n in _json_numbers(json.loads((results / f"{name}.json").read_text()),
                                          in_strings=name.endswith(".provenance"))]
        if not numbers:
            problems.append(f"{claim}: its pages cite no bench/results JSON")
            continue
        quoted = re.sub(r"`[^`\n]*`", "", re.sub(r"\]\([^)]*\)", "]", row))  # link targets and code are not figures
        problems += [f"{claim}: {sign}{figure}{percent}" for sign, figure, percent in FIGURE.findall(quoted)
                     if not _matches(sign, figure, percent, numbers)]
    return problems


def test_every_figure_in_the_results_tables_is_in_the_json_it_cites():
    bad = [f"{table.relative_to(REPO)}: {p}" for table, heading in RESULTS_TABLES for p in _unbacked_figures(table, heading)]
    assert not bad, ("figures in the results tables that the JSON their pages cite does not hold "
                     "(rounded to the figure's precision):\n" + "\n".join(bad))


def test_the_rows_left_unchecked_are_still_rows():
    claims = [r.strip("|").split("|")[0].strip().lower() for table, heading in RESULTS_TABLES
              for r in _table_rows(table.read_text(), heading)]
    for start in FIGURES_NOT_CHECKED:
        assert any(c.startswith(start) for c in claims), f"FIGURES_NOT_CHECKED names no row: {start!r}"


def test_the_figure_checker_catches_what_it_should(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "run.json").write_text(json.dumps({
        "acc_sft": 0.390625, "acc_rl": 0.4375, "gain": 0.046875, "diff": -0.0098, "ratio": 0.8796,
        "share": 0.3617, "rows": [{"seed": 0, "gain": 0.205}], "series": [0.123] * (SERIES_MAX + 1)}))
    (results / "run.provenance.json").write_text(json.dumps({"load_before": "2.68 3.46 3.54"}))
    (results / "other.json").write_text(json.dumps({"value": 0.777}))
    (results / "other.provenance.json").write_text("{}")
    pages = tmp_path / "docs" / "results"
    pages.mkdir(parents=True)
    (pages / "page.md").write_text("# Page\n\n## Run\n\n`bench/results/run.json`, provenance "
                                   "`bench/results/run.provenance.json`\n\n## Other\n\n`bench/results/other.json`\n")
    (pages / "index.md").write_text(
        "| claim | figure | page |\n|---|---|---|\n"
        "| good | +0.047 (0.391 → 0.438), 0.88x, −0.010, 36.2%, seed +0.205, three 0.5B agents, 3.46, 20 runs "
        "| [p](page.md#run) |\n"
        "| wrong digit | 0.439 | [p](page.md#run) |\n"
        "| wrong sign | −0.047 | [p](page.md#run) |\n"
        "| too precise | 0.8795 | [p](page.md#run) |\n"
        "| from a series | 0.123 | [p](page.md#run) |\n"
        "| from another section | 0.777 | [p](page.md#run) |\n"
        "| the other section | 0.777 | [p](page.md#other) |\n"
        "| no such anchor | 0.438 | [p](page.md#nowhere) |\n"
        "| rl adds to sft, left unchecked | 9.999 | [p](page.md#run) |\n")
    found = _unbacked_figures(pages / "index.md", None, results, unchecked=("rl adds to sft",))
    assert sorted(found) == sorted([
        "wrong digit: 0.439", "wrong sign: −0.047", "too precise: 0.8795", "from a series: 0.123",
        "from another section: 0.777", "no such anchor: page.md#nowhere is no page or section",
        "no such anchor: its pages cite no bench/results JSON"]), found


# -- the first run as the README and the quickstart show it ------------------------------------
# bench/first_run.py records `make run` on a fresh clone (bench/results/first-run.json, and the
# terminal in first-run.log): the minutes the pages quote are its own, rounded, and every line of
# output they paste is a line the run printed.

FIRST_RUN = RESULTS_DIR / "first-run.json"
FIRST_RUN_PAGES = ((REPO / "README.md", "the-first-run"), (REPO / "docs" / "quickstart.md", ""))
PASTED = re.compile(r"^(iteration \d+/\d+ |held-out team accuracy|final reward per agent)")
MINUTES = re.compile(r"about (\d+)\s+minutes\s+after\s+setup")


def _pasted_lines(text: str) -> list[str]:
    blocks = re.findall(r"```text\n(.*?)```", text, re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if PASTED.match(line.strip())]


def _first_run_problems(text: str, record: dict, printed: set[str]) -> list[str]:
    out = [f"pasted line not printed by the recorded run: {line!r}"
           for line in _pasted_lines(text) if line not in printed]
    for m in MINUTES.finditer(text):
        if int(m.group(1)) != round(record["make_run_s"] / 60):
            out.append(f"'{m.group(0)}': the record's `make run` took {record['make_run_s'] / 60:.1f} min")
    return out


def test_the_first_run_the_pages_show_is_the_recorded_one():
    record = json.loads(FIRST_RUN.read_text())
    printed = {line.strip() for line in FIRST_RUN.with_suffix(".log").read_text().splitlines()}
    bad = []
    for page, anchor in FIRST_RUN_PAGES:
        section = _section(page.read_text(), anchor)
        assert section is not None and _pasted_lines(section), f"{page.name}: no pasted output under #{anchor}"
        bad += [f"{page.relative_to(REPO)}: {p}" for p in _first_run_problems(section, record, printed)]
    assert not bad, "\n".join(bad)


def test_the_first_run_check_catches_what_it_should():
    record = {"make_run_s": 259.0}
    printed = {"iteration 20/20  E2E 4.80 s  acc 0.242"}
    good = "about 4 minutes after setup\n```text\niteration 20/20  E2E 4.80 s  acc 0.242\n```\n"
    assert _first_run_problems(good, record, printed) == []
    bad = "about 19 minutes after setup\n```text\niteration 20/20  E2E 4.81 s  acc 0.242\n```\n"
    assert len(_first_run_problems(bad, record, printed)) == 2
