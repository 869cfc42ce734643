"""The GPU check's dry run: bench/gpu_check.py end to end on the CPU, as a GPU session would run it
(the real script in a subprocess, the team run through Prefect and Dask included), so the script
is known to work before a lent GPU's minutes are spent on it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECKS = [
    "greedy_cpu_vs_device/tiny-1m",
    "logprobs_engine_vs_trainer/tiny-1m",
    "train_step_fp32/tiny-1m",
    "train_step_bf16/tiny-1m",
    "state_swap/tiny-1m",
    "team_run",
]


def test_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["dry_run"] and res["passed"]
    for name in CHECKS:
        assert res["checks"][name]["passed"] is True, (name, res["checks"].get(name))
    assert res["checks"]["state_swap/tiny-1m"]["bit_exact"] is True
    for name in ("greedy_cpu_vs_device/tiny-1m", "logprobs_engine_vs_trainer/tiny-1m"):
        assert 0 < res["checks"][name]["logprob_bound"] < 1e-3  # fp32-sized, from the dtype
    assert res["checks"]["train_step_bf16/tiny-1m"]["rel_tol"] > res["checks"]["train_step_fp32/tiny-1m"]["rel_tol"]
    assert res["checks"]["team_run"]["iterations"] == 1
    assert res["checks"]["team_run"]["workers_device"] == "cpu"  # the dry run's device
    rows = {(r["kind"], r["batch"]): r for r in res["throughput"]}
    plan = res["plan"]
    assert set(rows) == {("generate", b) for b in plan["gen_batches"]} | {("train", b) for b in plan["train_batches"]}
    assert all(r["device"]["tok_s"] > 0 for r in rows.values())
    assert all(r["device"]["step_s"] > 0 for (kind, _), r in rows.items() if kind == "train")
    skipped = res["skipped"]
    for part in ("cpu_figures", "vllm", "deepspeed"):
        assert isinstance(skipped.get(part), str) and skipped[part], (part, skipped)
    for extra in ("vllm", "deepspeed"):  # the reason says which of the two cases it is
        want = "--dry-run" if importlib.util.find_spec(extra) else "not importable"
        assert want in skipped[extra]


def test_swap_only(tmp_path: Path) -> None:
    """--swap-only runs the swap check alone (the re-check after a change to training/handles.py)."""
    out = tmp_path / "swap.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--swap-only", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res["checks"]) == ["state_swap/tiny-1m"] and res["passed"]
    assert res["checks"]["state_swap/tiny-1m"]["bit_exact"] is True
    assert "throughput" not in res
