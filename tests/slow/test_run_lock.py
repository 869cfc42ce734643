"""A run folder has one owner: a second `flexmarl train` on it (a forgotten `--resume`, a
double launch, two at the same moment) stops with one line and leaves the first run intact;
a fresh run over a finished one needs `--overwrite`; a dead run's lease is taken over by
`--resume`; the audit fails a folder two runs wrote into."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexmarl_core.driver.audit import audit_run
from flexmarl_core.driver.lease import (
    LEASE_NAME,
    Lease,
    RunExistsError,
    RunLease,
    RunLockedError,
    check_claim,
    read_lease,
)
from flexmarl_core.runfiles.location import RunLocation
from flexmarl_core.stages.faults import faults_dir, held_ops, release
from tests._runs import COMMON, TINY

REPO = Path(__file__).resolve().parents[2]
HELD = "step[planner] it=0"


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _env(prefect_api: str) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}


def _sets(run_dir: Path) -> list[str]:
    return [x for o in [f"run_dir={run_dir}", *COMMON] for x in ("--set", o)]


def _ops(run_dir: Path) -> list[str]:
    log = run_dir / "metrics" / "ops.jsonl"
    return [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]


def test_a_second_launch_on_a_live_run_stops_with_one_line_and_leaves_it_intact(prefect_api, tmp_path):
    run_dir = tmp_path / "run"
    env = _env(prefect_api)
    folder = Path(faults_dir(run_dir))
    folder.mkdir(parents=True)
    (folder / f"hold@{HELD}").write_text("")  # the first run stays mid-iteration until released
    first = _cli("train", TINY, *_sets(run_dir), "--no-progress", env=env)
    try:
        deadline = time.time() + 300
        while HELD not in held_ops(run_dir) and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert HELD in held_ops(run_dir), first.communicate()[1][-3000:] if first.poll() is not None else "no hold"
        lease = read_lease(RunLocation(run_dir))
        assert lease is not None and lease.pid == first.pid and lease.alive()
        before = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
        # Forgetting --resume, asking to overwrite, resuming: each one error line, exit 2.
        for extra in ([], ["--overwrite"]):
            second = _cli("train", TINY, *_sets(run_dir), "--no-progress", *extra, env=env)
            out, err = second.communicate(timeout=120)
            assert second.returncode == 2, (extra, out[-2000:], err[-2000:])
            lines = err.strip().splitlines()
            assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and "in use" in lines[0], (extra, err)
        again = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
        out, err = again.communicate(timeout=120)
        assert again.returncode == 2 and f"pid {first.pid}" in err, err
        after = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
        assert set(before) <= set(after)  # nothing of the first run deleted
        release(run_dir, HELD)
        out, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
    assert not (run_dir / LEASE_NAME).exists()  # released at the end
    names = _ops(run_dir)
    assert len(names) == len(set(names))
    res = subprocess.run([sys.executable, "-m", "flexmarl.cli", "store", "audit", str(run_dir)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and ": clean" in res.stdout, res.stdout
    # A finished run is not replaced by a fresh launch without --overwrite.
    res = subprocess.run([sys.executable, "-m", "flexmarl.cli", "train", TINY, *_sets(run_dir), "--no-progress"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--resume" in res.stderr and "--overwrite" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert _ops(run_dir) == names


def test_two_launches_at_the_same_moment_run_once(prefect_api, tmp_path):
    """The loser of two launches at the same moment is refused like any second launch (one
    line naming the winner, exit 2) and leaves no flow run behind: the lease is taken before
    the flow run is made."""
    run_dir = tmp_path / "run"
    env = _env(prefect_api)
    procs = [_cli("train", TINY, *_sets(run_dir), "--no-progress", env=env) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [o[1][-1500:] for o in outs]
    winner = procs[[p.returncode for p in procs].index(0)]
    _, err = outs[[p.returncode for p in procs].index(2)]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "in use by another flexmarl train" in lines[0] and f"pid {winner.pid}" in lines[0], err
    assert _training_runs(run_dir) == ["COMPLETED"]  # the winner's flow run, and no other
    names = _ops(run_dir)
    assert len(names) == len(set(names))
    run = audit_run(str(run_dir))
    assert run.problems == [] and run.verdict() == "clean"


def _training_runs(run_dir: Path) -> list[str]:
    """The state of every training flow run in the API whose overrides name `run_dir`."""
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async def read() -> list[str]:
        runs: list = []
        async with get_client() as c:
            while page := await c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["flexmarl-train"])),
                                                 limit=200, offset=len(runs)):
                runs += page
        return [r.state.type.value for r in runs if f"run_dir={run_dir}" in (r.parameters.get("overrides") or [])]

    return asyncio.run(read())


def test_a_dead_runs_lease_is_taken_over_by_resume_only(tmp_path):
    loc = RunLocation(tmp_path / "run")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no process has now
    Path(loc.root).mkdir(parents=True)
    (Path(loc.root) / ".flexmarl-run").write_text("")
    stale = Lease(socket.gethostname(), dead.pid, 1, time.time() - 5, time.time() - 5, "t0", None)
    (Path(loc.root) / LEASE_NAME).write_text(json.dumps(stale.__dict__))
    assert not stale.alive()
    with pytest.raises(RunExistsError, match="--resume"):
        check_claim(loc, resume=False, overwrite=False)
    with RunLease.acquire(loc, resume=True, overwrite=False) as held:
        assert held.taken_from == stale and read_lease(loc).pid == os.getpid()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):  # alive now: nobody else
            RunLease.acquire(loc, resume=True, overwrite=False)
    assert read_lease(loc) is None


def test_the_audit_fails_a_folder_two_runs_wrote_into(baseline, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(baseline.resolved_run_dir(), run_dir)  # a copy resumes, and is audited, where it is
    clean = audit_run(str(run_dir))
    assert clean.problems == [] and clean.iterations == [0, 1] and clean.ops > 0 and clean.samples > 0
    ops = (run_dir / "metrics" / "ops.jsonl").read_text().splitlines()
    rollout = next(x for x in ops if json.loads(x)["kind"] == "rollout")
    its = (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()
    (run_dir / "metrics" / "ops.jsonl").write_text("\n".join([*ops, rollout]) + "\n")
    (run_dir / "metrics" / "iterations.jsonl").write_text("\n".join([*its, its[0]]) + "\n")
    kinds = {p.kind for p in audit_run(str(run_dir)).problems}
    assert kinds == {"op_twice", "iterations_out_of_order"}, kinds
