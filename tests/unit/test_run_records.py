"""What a run leaves for readers other than its terminal, without a server: each iteration's
own record (its flow run's log lines and artifact, `tasks/iteration_record.py`), paths shown
relative, the state a run's leftovers end in and the record of its attempts
(`tasks/leftovers.py`), and the run folder's lease under two launches at once."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from flexmarl_core.control import MoveInstance, Resubmit, TrainSlot
from flexmarl_core.ops import Op, OpRecord, StageResult
from flexmarl_core.runfiles.location import RunLocation, shown

ROW = {"iteration": 2, "e2e_s": 1.5, "tokens": 100, "tokens_per_s": 66.7, "utilization": 0.5, "accuracy": 0.25,
       "agent/planner/reward": 0.5, "agent/solver/reward": 0.25}


def _rec(op: Op, t0: float, t1: float, worker: str = "w0") -> OpRecord:
    return OpRecord(op, t0, t1, StageResult(op, worker=worker, t_start=t0, t_end=t1))


def test_an_iterations_record_has_its_line_decisions_ops_and_the_waits_prefect_cannot_draw():
    from tasks.iteration_record import IterationRecord, decision_iteration, log_lines, markdown

    first, later = Op(2, "rollout", "planner", mb=0), Op(2, "reward", mb=0)
    slot = TrainSlot(t=1.0, agent="solver", iteration=2, worker="w1", state_was_on="w0", swap=True, loads={},
                     work_s={})
    move = MoveInstance(t=1.0, worker="w0", to_agent="solver", from_agent="planner", loads={"solver": 2.0},
                        cost_bytes=10, monitor_us=1.0, decide_us=1.0)
    again = Resubmit(t=1.0, op="reward it=3 mb=1", worker="w1", error="KilledWorker: gone")
    assert [decision_iteration(d) for d in (slot, move, again)] == [2, None, 3]
    rec = IterationRecord(2, ROW, [_rec(later, 11.0, 11.5), _rec(first, 10.0, 10.8)], [slot, move],
                          {first.name: ["sync[planner] it=1"]})
    lines = log_lines(rec, "team", 5)
    assert lines[0].startswith("iteration 3/5  E2E 1.50 s  acc 0.250")
    assert lines[1] == "train_slot: solver's training of iteration 2 on w1 (its state swapped in from w0)"
    assert lines[2].startswith("move_instance: worker w0 now serves solver instead of planner")
    assert lines[3] == "waited on ops of other flow runs, drawn there: sync[planner] it=1 (in flow run team it 1)"
    # Where its flow run holds several iterations, the record names that flow run.
    rec.where = {1: "team it 0-1"}
    assert log_lines(rec, "team", 5)[3].endswith("sync[planner] it=1 (in flow run team it 0-1)")
    md = markdown(rec, "team", 5)
    rows = [x for x in md.splitlines() if x.startswith(("| rollout[", "| reward it="))]
    assert rows == [f"| {first.name} | w0 | 0.00 | 0.80 | sync[planner] it=1 |", f"| {later.name} | w0 | 1.00 | 0.50 |  |"]
    assert "| reward solver | 0.25 |" in md and "## decisions" in md, md
    # An iteration all of whose ops ran in an earlier attempt says so; no waits, no such line.
    bare = IterationRecord(2, ROW)
    assert "ran in an earlier attempt" in markdown(bare, "team", 5) and len(log_lines(bare, "team", 5)) == 1


def test_paths_are_shown_relative_never_as_this_machines_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shown(tmp_path / "runs" / "x") == "runs/x"
    assert shown(tmp_path / "runs" / "x" / "timeline.png", tmp_path / "runs" / "x") == "timeline.png"
    assert shown("s3://bucket/runs/x") == "s3://bucket/runs/x"
    assert shown(Path.home() / "r") == "~/r" or Path.home() == tmp_path
    outside = Path("/") / "srv-not-here" / "data" / "runs" / "x"
    assert shown(outside) == ".../runs/x"


def test_a_runs_leftovers_end_in_the_state_that_matches_how_it_ended(tmp_path):
    from prefect.exceptions import TerminationSignal

    from tasks import leftovers

    assert leftovers.ending(None) == "COMPLETED"
    assert leftovers.ending(ValueError("x")) == "FAILED"
    assert leftovers.ending(KeyboardInterrupt()) == "CRASHED"
    assert leftovers.ending(TerminationSignal(15)) == "CRASHED"  # no cancellation was asked for
    assert leftovers.reason("FAILED", ValueError("bad op\nmore")) == "the training run ended Failed: ValueError: bad op"
    assert leftovers.state("CANCELLED", "why").type.value == "CANCELLED"
    # The record: an attempt that stopped before `begin` (a folder it may not write) writes
    # nothing; a recorded one says how it ended.
    loc = RunLocation(tmp_path / "run")
    os.makedirs(loc.root)
    leftovers.end(loc, "f0", ValueError("early"))
    assert not loc.exists(leftovers.RECORD)
    leftovers.begin(loc, "f1", "http://api")
    leftovers.end(loc, "f1", RuntimeError("stage broke"))
    (a,) = json.loads(loc.read_text(leftovers.RECORD))["attempts"]
    assert (a["flow_run"], a["api"], a["ended"], a["closed"], a["pid"]) == ("f1", "http://api", "FAILED", False, os.getpid())
    assert "stage broke" in a["message"]
    assert leftovers.close_earlier(loc, None) == 0  # no API: nothing asked


def test_two_launches_at_once_one_takes_the_folder_the_other_gets_the_second_launchs_line(tmp_path):
    from flexmarl_core.driver.lease import RunLease, RunLockedError, read_lease

    for attempt in range(5):  # the race, run a few times: each time one wins, one is refused alike
        loc = RunLocation(tmp_path / f"run{attempt}")
        go, got = threading.Barrier(2), []

        def launch(loc: RunLocation = loc, go: threading.Barrier = go, got: list = got) -> None:
            go.wait()
            try:
                got.append(RunLease.acquire(loc, resume=False, overwrite=False))
            except RunLockedError as exc:
                got.append(exc)

        threads = [threading.Thread(target=launch) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [g for g in got if isinstance(g, RunLease)]
        lost = [g for g in got if isinstance(g, RunLockedError)]
        assert len(won) == 1 and len(lost) == 1, got
        assert "is in use by another flexmarl train" in str(lost[0]) and f"pid {os.getpid()}" in str(lost[0])
        assert sorted(os.listdir(tmp_path)) == sorted(f"run{i}" for i in range(attempt + 1))  # no temp file left
        # The flow adopts the lease its process took, and names its flow run in it.
        held = won[0]
        assert RunLease.adopt(loc, "flow-1") is held and read_lease(loc).flow_run == "flow-1"
        held.release()
        assert RunLease.adopt(loc, "flow-2") is None and read_lease(loc) is None


def test_auto_flow_runs_hold_one_iteration_until_the_pace_is_known_then_five_seconds_of_it():
    from tasks.iteration_runs import BLOCK_S, MAX_BLOCK, PACE_ENDS, block_size

    assert [block_size(n, 0.1 * n) for n in range(PACE_ENDS)] == [1] * PACE_ENDS
    assert block_size(3, 0.3) == round(BLOCK_S / 0.1)
    assert block_size(4, 16.0) == 2
    assert block_size(3, 180.0) == 1  # long iterations: one each
    assert block_size(3, 0.003) == MAX_BLOCK
    # The pace is the attempt's own (ends over the time since its first op): rows that become
    # final together, held behind an older op, do not make it zero.
    assert block_size(3, 0.0) == 1
