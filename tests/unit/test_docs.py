"""The product face: the README stays a product page whose links resolve, the docs site builds
in strict mode (a broken link, a missing page or an unknown anchor fails it), the generated
configuration reference matches the config models, and every results page points at committed
JSON with its provenance."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl import config_reference

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
RESULTS = REPO / "bench" / "results"
README_MAX_LINES = 300

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _links(text: str) -> list[str]:
    text = FENCE.sub("", text)  # links inside code blocks are code, not links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [a or b for a, b in LINK.findall(text)]


def _slug(title: str) -> str:
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(re.sub(r"[`*]", "", m)) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def test_readme_is_a_product_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    assert "make run" in README.read_text() and "make test" in README.read_text()


def test_readme_links_resolve():
    bad = []
    for target in _links(README.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (REPO / path) if path else README
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(REPO)}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, "README links that do not resolve:\n" + "\n".join(bad)


def test_readme_results_link_to_results_pages():
    """Every figure of the README's results table links to a page under docs/results/."""
    text = README.read_text()
    table = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("|") and not set(r) <= set("|- ")][1:]
    assert rows, "no results table under ## Results"
    for row in rows:
        targets = _links(row)
        assert targets and all(t.startswith("docs/results/") for t in targets), row


def test_config_reference_is_generated_from_the_models():
    page = config_reference.PAGE
    assert page.is_file(), f"{page} missing: run python -m flexmarl.config_reference --write"
    assert page.read_text() == config_reference.render(), (
        "docs/reference/config.md is stale: run python -m flexmarl.config_reference --write")


def test_config_reference_covers_every_field():
    from flexmarl_core.config import ExperimentConfig

    text = config_reference.render()
    sections: list = []
    config_reference._models(ExperimentConfig, "", sections)
    for _, model in sections:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no Field description"
            assert f"| `{name}` |" in text, f"{model.__name__}.{name} missing from the reference"


@pytest.mark.parametrize("page", sorted(p.name for p in (DOCS / "results").glob("*.md")
                                        if p.name not in ("index.md", "earlier.md")))
def test_results_page_has_its_json_and_provenance(page):
    text = (DOCS / "results" / page).read_text()
    names = sorted(set(re.findall(r"bench/results/([\w.-]+)\.json", text)))
    data = [n for n in names if not n.endswith(".provenance")]
    assert data, f"docs/results/{page} names no bench/results/*.json"
    for name in data:
        assert json.loads((RESULTS / f"{name}.json").read_text()), name
        sidecar = RESULTS / f"{name}.provenance.json"
        if sidecar.exists():  # record.sh's
            prov = json.loads(sidecar.read_text())
            loads = {"load before": prov.get("load_before"), "load after": prov.get("load_after")}
        else:  # a recorder that writes its own provenance into the record (bench/first_run.py)
            prov = json.loads((RESULTS / f"{name}.json").read_text())
            loads = {"load before": " ".join(prov.get("load_before") or []) or None,
                     "mean load": str((prov.get("load") or {}).get("mean", "")) or None}
        for key in ("command", "commit", "start_utc", "machine"):
            assert prov.get(key), f"{name}: its provenance lacks {key}"
        assert prov.get("exit_code", 0) == 0, f"{name}: the bench exited {prov['exit_code']}"
        # The page's provenance is hand-written: it must say what the recorder wrote.
        for key, value in (("commit", prov["commit"][:7]), ("date", prov["start_utc"][:10]), *loads.items()):
            assert value and value in text, f"docs/results/{page}: the {key} of {name} ({value}) is not on the page"


def test_docs_build_strict(tmp_path):
    """mkdocs in strict mode: a broken link, a page missing from the nav or an unknown anchor
    is an error. Built into a temporary folder."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "config.html").is_file()
