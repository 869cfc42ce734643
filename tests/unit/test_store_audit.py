"""`flexmarl store audit`: exactly-once audit of a MEG Store, run as a user would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from storage import MEGStore

FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))


def audit(path: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run([FLEXMARL, "store", "audit", str(path)], capture_output=True,
                          text=True, timeout=120)


def _store(root: Path) -> MEGStore:
    store = MEGStore(str(root))
    for it in (0, 1):
        store.write_samples("solver", it, [
            {"input_id": f"p{i}", "traj": t, "turn": 0, "mb": i, "policy_version": it,
             "prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5],
             "prompt_text": "Q", "response_text": "A"} for i in range(2) for t in range(2)
        ])
        store.write_status("solver", it, [
            {"sample_id": f"p0:{t}:solver:0", "policy_version": it, "mb": 0, "reward": 1.0}
            for t in range(2)
        ])
    return store


def test_clean_store_passes(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    res = audit(tmp_path / "store")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 error(s)" in res.stdout


def test_planted_duplicate_fails_naming_the_sample(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _store(root)
    part = root / "samples" / "agent=solver" / "iteration=1"
    frag = sorted(part.glob("mb000001-*.parquet"))[0]
    # A second committed copy under another name: what a writer that lost track of its first
    # commit would leave. Readers deduplicate it; the audit must not.
    shutil.copy(frag, part / "mb000001-0123456789abcdef.parquet")
    res = audit(root)
    assert res.returncode == 1, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if "duplicate" in ln)
    assert line.startswith("ERROR") and str(part) in line
    assert "p1:0:solver:0" in line and "p1:1:solver:0" in line
    assert "p0:" not in line  # only micro-batch 1 was copied


def test_orphan_status_row_fails(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = _store(root)
    store.write_status("solver", 0, [{"sample_id": "p9:0:solver:0", "policy_version": 0,
                                      "mb": 0, "reward": 0.0}])
    res = audit(root)
    assert res.returncode == 1
    assert "orphan_status" in res.stdout and "p9:0:solver:0" in res.stdout


def test_neither_store_nor_run_exits_2(tmp_path: Path) -> None:
    res = audit(tmp_path / "nothing")
    assert res.returncode == 2 and "no MEG store" in res.stderr
    assert "Traceback" not in res.stderr
    (tmp_path / "empty").mkdir()
    res = audit(tmp_path / "empty")
    assert res.returncode == 2 and "neither a MEG store nor a run folder" in res.stderr


def test_lost_samples_are_a_finding_and_a_damaged_fragment_an_error_naming_it(tmp_path: Path) -> None:
    """Samples recorded as lost are one warning naming them (their status rows are no orphans),
    not missing; a fragment that cannot be read is one error naming the file, and the audit
    goes on with the other partitions instead of stopping."""
    from storage import audit_store

    root = tmp_path / "store"
    _store(root)
    part = root / "samples" / "agent=solver" / "iteration=0"
    frag = sorted(part.glob("mb000000-*.parquet"))[0]
    frag.unlink()  # micro-batch 0's samples, whose status rows stay
    ids = {(a, it): [f"p{i}:{t}:solver:0" for i in range(2) for t in range(2)] for a, it in [("solver", 0), ("solver", 1)]}
    lost = {("solver", 0): ["p0:0:solver:0", "p0:1:solver:0"]}
    problems = audit_store(str(root), ids, lost)
    (found,) = problems
    assert (found.kind, found.severity) == ("lost", "warning")
    assert found.message == "2 samples lost to damage, trained before it: p0:0:solver:0, p0:1:solver:0"
    assert [p.kind for p in audit_store(str(root), ids)] == ["orphan_status", "missing"]  # unrecorded: errors
    bad = sorted((root / "samples" / "agent=solver" / "iteration=1").glob("*.parquet"))[0]
    bad.write_bytes(bad.read_bytes()[:100])
    problems = audit_store(str(root), ids, lost)
    assert [(p.kind, p.severity) for p in problems] == [("lost", "warning"), ("unreadable", "error")]
    assert problems[1].path == str(bad)
    res = audit(root)
    assert res.returncode == 1 and "Traceback" not in res.stderr and str(bad) in res.stdout
