"""A resume checks the store first: a damaged fragment stops it with the file named and the
repair command; `flexmarl store repair` sets the fragment aside and rewinds the ops that wrote
it, and the resumed run writes the same rows again. The run folder is a copy of another run,
moved after copying: it resumes where it is, and the original is never touched. Real CLI,
flow, Dask and Parquet."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from flexmarl_core.driver.audit import audit_run
from storage import MEGStore

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


def test_a_damaged_store_stops_a_resume_and_a_repair_makes_it_whole(baseline, prefect_api, tmp_path):
    original = baseline.resolved_run_dir()
    before = _tree(original)
    shutil.copytree(original, tmp_path / "copy")
    run_dir = (tmp_path / "copy").rename(tmp_path / "run")  # copied, then moved
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    # Iteration 1 sampled with the solver's weights v1, which the run no longer keeps (k = 0:
    # the initial and the newest): its damage cannot be written again, and the repair says so,
    # changing nothing.
    (late,) = (run_dir / "store" / "samples" / "agent=solver" / "iteration=1").glob("all-*.parquet")
    whole = late.read_bytes()
    late.write_bytes(whole[: len(whole) // 2])
    res = _cli("store", "repair", str(run_dir), env=env)
    assert res.returncode == 2 and "no longer keeps" in res.stderr and "train.keep_every" in res.stderr, res.stderr
    assert late.exists()
    late.write_bytes(whole)
    # Iteration 0 sampled with v0, which every run keeps. The run compacted the partition: its
    # one fragment holds every micro-batch's samples with their rewards and consumption.
    part = run_dir / "store" / "samples" / "agent=solver" / "iteration=0"
    (frag,) = part.glob("all-*.parquet")
    frag.write_bytes(frag.read_bytes()[: frag.stat().st_size // 2])  # truncated mid-file
    res = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and frag.name in line and f"flexmarl store repair {run_dir}" in line, line
    res = _cli("store", "repair", str(run_dir), env=env)
    assert res.returncode == 0 and frag.name in res.stdout, res.stdout + res.stderr
    assert not frag.exists()
    res = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = audit_run(str(run_dir))
    assert run.problems == [] and run.verdict() == "clean"
    got, want = (MEGStore(str(d / "store")).read_samples("solver", 0).select(
        ["sample_id", "response_ids", "reward", "consumed_step"]).sort_by("sample_id").to_pylist()
        for d in (run_dir, baseline.resolved_run_dir()))
    assert got == want  # the same tokens, rewards and consumption as before the damage
    assert _tree(original) == before  # the run the folder was copied from is untouched
