"""The core's import boundaries: `flexmarl_core` never imports Prefect, and only the cluster
adapter (`flexmarl_core/cluster.py`) imports Dask. Checked on every import statement of every
core module (function-level ones too), and on what importing the core loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "flexmarl_core"
DASK_ADAPTER = CORE / "cluster.py"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_core_never_imports_prefect_and_only_the_adapter_imports_dask():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 30
    bad = []
    for f in files:
        mods = _imports(f)
        if "prefect" in mods or "prefect_dask" in mods:
            bad.append(f"{f.relative_to(REPO)} imports prefect")
        if f != DASK_ADAPTER and mods & {"dask", "distributed"}:
            bad.append(f"{f.relative_to(REPO)} imports dask")
    assert not bad, bad


def test_importing_the_run_path_loads_no_prefect_or_dask():
    code = ("import sys; import flexmarl_core.run, flexmarl_core.stages, flexmarl_core.control, "
            "flexmarl_core.executors, flexmarl_core.metrics; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'dask', 'distributed'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
