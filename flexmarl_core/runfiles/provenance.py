"""What code made a run: the flexmarl version and the git commit of the checkout that prepared
it, kept in the run folder (`PROVENANCE_NAME`) so that a model exported from the run years later
still says where it came from (`flexmarl export` puts it in the model card)."""

from __future__ import annotations

import json
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from flexmarl_core.runfiles.location import RunLocation

PROVENANCE_NAME = "provenance.json"
_REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """The flexmarl version, and where it runs from a git checkout, its commit and whether the
    checkout had uncommitted changes (a wheel install has no commit: None)."""
    try:
        version = metadata.version("flexmarl")
    except metadata.PackageNotFoundError:
        version = None
    commit = _git("rev-parse", "HEAD")
    dirty = None if commit is None else bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {"flexmarl": version, "commit": commit, "dirty": dirty, "created": time.time()}


def record(loc: RunLocation) -> None:
    """Write the provenance of a run being prepared (kept as it is on a resume)."""
    if not loc.is_file(PROVENANCE_NAME):
        loc.write_text(PROVENANCE_NAME, json.dumps(provenance(), indent=1))


def read(loc: RunLocation) -> dict[str, Any]:
    """A run's provenance; empty for a run prepared before it was recorded."""
    try:
        return dict(json.loads(loc.read_text(PROVENANCE_NAME)))
    except (FileNotFoundError, ValueError):
        return {}
