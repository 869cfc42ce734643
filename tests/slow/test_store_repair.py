"""A resume checks the store first: a damaged fragment stops it with the file named and the
repair command, and so does the audit; `flexmarl store repair` sets the fragment aside and
either rewinds the ops that wrote it, and the resumed run writes the same rows again, or,
where the weights that sampled it are gone and its samples were trained on, records them as
lost, which the audit then names as its one finding. The run folder is a copy of another run,
moved after copying: it resumes where it is, and the original is never touched. Real CLI,
flow, Dask and Parquet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from flexmarl_core.driver.audit import audit_run
from flexmarl_core.driver.repair import check_before_resume
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
    # Each partition was compacted by the run: one fragment holds every micro-batch's samples
    # with their rewards and consumption. Iteration 1 sampled with the solver's weights v1,
    # which the run no longer keeps (k = 0: the initial and the newest) and trained into v2,
    # which it keeps: history. Iteration 0 sampled with v0, which every run keeps.
    late, frag = ((run_dir / "store" / "samples" / "agent=solver" / f"iteration={it}").glob("all-*.parquet")
                  for it in (1, 0))
    (late,), (frag,) = late, frag
    for f in (late, frag):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated mid-file
    res = _cli("store", "audit", str(run_dir), env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    for f in (late, frag):
        (line,) = [x for x in res.stdout.splitlines() if f.name in x]
        assert line.startswith("ERROR") and f"flexmarl store repair {run_dir}" in line, line
    res = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and frag.name in line and f"flexmarl store repair {run_dir}" in line, line
    res = _cli("store", "repair", str(run_dir), env=env)
    assert res.returncode == 0 and frag.name in res.stdout and late.name in res.stdout, res.stdout + res.stderr
    assert "lost: 8 samples" in res.stdout and "writes 1 of them again" in res.stdout, res.stdout
    assert not frag.exists() and not late.exists()
    check_before_resume(str(run_dir))  # nothing damaged is left for a resume to refuse
    # --skip-check resumes without the check, and its summary says so.
    res = _cli("train", "--resume", str(run_dir), "--no-progress", "--skip-check", env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "--skip-check: the store was not checked before the resume" in res.stdout, res.stdout[-3000:]
    run = audit_run(str(run_dir))
    (lost,) = run.problems  # the samples lost with iteration 1's fragment, named, and nothing else
    ids = [f"{i}:{t}:solver:0" for i in MEGStore(str(run_dir / "store")).read_inputs(1).column("input_id").to_pylist()
           for t in range(2)]
    assert (lost.kind, lost.severity) == ("lost", "warning") and "agent=solver/iteration=1" in lost.path
    assert lost.message.startswith("8 samples lost to damage, trained before it") and all(i in lost.message for i in ids)
    assert run.verdict() == "clean but for 8 samples lost to damage, trained before it"
    got, want = (MEGStore(str(d / "store")).read_samples("solver", 0).select(
        ["sample_id", "response_ids", "reward", "consumed_step"]).sort_by("sample_id").to_pylist()
        for d in (run_dir, baseline.resolved_run_dir()))
    assert got == want  # the same tokens, rewards and consumption as before the damage
    # Each iteration's row once: iteration 0's keeps its first figures, marked rebuilt.
    rows, first = ([json.loads(x) for x in (d / "metrics" / "iterations.jsonl").read_text().splitlines()]
                   for d in (run_dir, original))
    assert rows[0].pop("rebuilt_ops") > 0 and rows == first
    assert _tree(original) == before  # the run the folder was copied from is untouched
