"""The core's import boundaries: `flexmarl_core` never imports Prefect, only the cluster adapter
(`flexmarl_core/cluster/`) imports Dask, and the optional backends' packages (vLLM, DeepSpeed,
PEFT) are imported only by their own backend modules. Checked on every import statement of
every core module (function-level ones too), and on what importing the core loads."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "flexmarl_core"
DASK_ADAPTER = CORE / "cluster"
#: optional extra -> the only core modules that import it
BACKENDS = {
    "vllm": {"inference/vllm_engine.py", "inference/vllm_lora.py"},
    "deepspeed": {"training/deepspeed_trainer.py"},
    "peft": {"models/lora.py"},
}


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
        if f.parent != DASK_ADAPTER and mods & {"dask", "distributed"}:
            bad.append(f"{f.relative_to(REPO)} imports dask")
    assert not bad, bad


def test_importing_the_run_path_loads_no_prefect_or_dask():
    code = ("import sys; import flexmarl_core.driver.run, flexmarl_core.stages, flexmarl_core.control, "
            "flexmarl_core.sim.threads, flexmarl_core.driver.metrics; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'dask', 'distributed'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_optional_backends_are_imported_only_by_their_backend_modules():
    bad = []
    for f in sorted(CORE.rglob("*.py")):
        rel = f.relative_to(CORE).as_posix()
        bad += [f"{rel} imports {pkg}" for pkg, allowed in BACKENDS.items()
                if pkg in _imports(f) and rel not in allowed]
    assert not bad, bad
    for pkg, allowed in BACKENDS.items():  # the rule names real modules that do import them
        assert all(pkg in _imports(CORE / rel) for rel in allowed), pkg


def test_config_and_cli_load_without_torch_or_prefect():
    """Reading a config (what the CLI does first, and what a bad one fails at) needs neither."""
    code = ("import sys; import flexmarl.cli, flexmarl_core.config; "
            "from flexmarl_core.config import load_config; load_config('configs/default.yaml'); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'prefect', 'dask', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_the_cluster_and_the_engine_contracts_load_without_torch():
    """`flexmarl cluster certs` (the certificates module) and a launch's cluster start (the
    workers module) need no torch or transformers in the driver, nor do code that only names
    the engines' contracts: the packages load their heavy modules on first use of a name."""
    code = ("import sys; import flexmarl_core.cluster.security, flexmarl_core.cluster.workers, "
            "flexmarl_core.inference.api; from flexmarl_core.inference import Generation; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
    # ... and a name of the heavy modules still loads from the package
    code = "from flexmarl_core import cluster, inference; print(cluster.DaskExecutor.__name__, inference.make_inference_engine.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["DaskExecutor", "make_inference_engine"]


def test_a_workers_warm_up_puts_its_imports_out_of_the_collectors_reach():
    """After `warm_up`'s imports a worker's full collections (and its exit) skip what torch and
    transformers made at import: they are frozen, and what comes later is not."""
    code = ("import gc, json; from flexmarl_core.cluster.workers import _import_runtime; "
            "before = gc.get_freeze_count(); _import_runtime(); frozen = gc.get_freeze_count(); "
            "later = [[] for _ in range(10)]; ids = {id(x) for x in later}; gc.collect(); "
            "print(json.dumps([before, frozen, gc.get_freeze_count(), sum(id(o) in ids for o in gc.get_objects())]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    before, frozen, after_collect, later_seen = json.loads(out.stdout)
    assert before == 0 and frozen > 100_000  # torch's and transformers' objects, frozen once
    assert after_collect == frozen  # a collection neither thaws them nor freezes what came later
    assert later_seen == 10  # ... the ten lists made later, which the collector still sees
