"""A reward has a deadline of its own, whether its op is fused with a rollout or not: past it,
the input's trajectories fail (named in the micro-batch's reward manifest and the iteration's
`failed_trajectories`), train nobody, and the run goes on; several inputs in a row past it stop
the run with one error naming the reward and the input. Through the real flow on Dask."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.runfiles.location import RunLocation
from flexmarl_core.workloads.bounded import Deadline, RewardHungError, RunStreak
from flows.train import train
from storage import MEGStore
from tests._runs import COMMON, TINY, flow

HANG = ["cluster.deadlines.per_kind_s.reward=2", "cluster.prefect_lean=true"]


def test_a_reward_that_hangs_on_one_input_fails_that_input_and_the_run_goes_on(dask_cluster, tmp_path, capsys):
    run_dir = tmp_path / "run"
    over = [*COMMON, *HANG, f"run_dir={run_dir}", f"cluster.address={dask_cluster}",
            "workload.reward=tests.reward_fns:hangs_on_one"]
    state = train(TINY, over, progress=True, return_state=True)  # the terminal's lines too
    assert state.is_completed(), state.message
    shown = capsys.readouterr().out
    (line,) = [x for x in shown.splitlines() if x.startswith("iteration 1/2")]
    assert "failed trajectories 2" in line, shown  # its input's G = 2 trajectories
    assert "failed trajectories" not in next(x for x in shown.splitlines() if x.startswith("iteration 2/2"))
    man = json.loads((run_dir / "rewards" / "it0" / "mb0.json").read_text())
    cfg = load_config(str(run_dir / "config.yaml"))
    assert sorted((f["input_id"], f["traj"]) for f in man["failed"]) == [("a0t1", t) for t in range(cfg.batch.group_size)]
    assert all("deadline of 2 s" in f["error"] or "its input's reward" in f["error"] for f in man["failed"])
    rows = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    assert [r["failed_trajectories"] for r in rows] == [cfg.batch.group_size, 0]
    store = MEGStore(cfg.resolved_store_uri())
    for agent in ("planner", "solver", "verifier"):
        tbl = store.read_samples(agent, 0).to_pylist()
        hung = [r for r in tbl if r["input_id"] == "a0t1"]
        assert hung and all(r["reward"] is None and r["consumed_step"] is None for r in hung)
        assert all(r["consumed_step"] == 0 for r in tbl if r["input_id"] != "a0t1")
    run = audit_run(str(run_dir))
    assert run.problems == [] and run.verdict() == "clean"


def test_a_reward_that_always_hangs_stops_the_run_naming_it_and_the_input(dask_cluster, tmp_path):
    over = [*COMMON, "cluster.deadlines.per_kind_s.reward=1", "cluster.deadlines.reward_timeouts=2",
            "cluster.prefect_lean=true", f"run_dir={tmp_path / 'run'}", f"cluster.address={dask_cluster}",
            "workload.reward=tests.reward_fns:always_hangs"]
    t0 = time.monotonic()
    state = flow(over)
    assert state.is_failed()
    msg = state.message or ""
    assert "tests.reward_fns:always_hangs" in msg and "2 inputs in a row" in msg and "input_id 'a0t" in msg, msg
    assert time.monotonic() - t0 < 240  # not the 1,000 s the reward sleeps, nor hung-op retries
    # Counted per run: both workers score inputs at once, and the run stops at 2 timeouts in
    # all, or 3 when the other worker's input in flight timed out before the stop reached it
    # (counted per worker, each needed 2 of its own: 4).
    timeouts = [n for n in os.listdir(tmp_path / "run" / "deadlines" / "reward") if n.startswith("t-")]
    assert 2 <= len(timeouts) <= 3, timeouts


def test_the_deadline_returns_in_time_results_and_raises_their_errors():
    d = Deadline("r", 5.0, 2)
    assert d.call(lambda: 3, "i0") == (True, 3)
    with pytest.raises(ZeroDivisionError):
        d.call(lambda: 1 / 0, "i0")
    slow = Deadline("r", 0.05, 2)
    assert slow.call(lambda: time.sleep(5), "i1") == (False, None)
    assert slow.call(lambda: 7, "i2") == (True, 7) and slow.in_a_row == 0  # a success resets the count
    slow.call(lambda: time.sleep(5), "i3")
    with pytest.raises(RewardHungError, match="2 inputs in a row.*'i4'"):
        slow.call(lambda: time.sleep(5), "i4")


def test_the_count_in_a_row_is_the_runs_across_its_processes(tmp_path):
    """Two worker processes' deadlines on one run folder: 3 timeouts in a row between them
    stop the run though neither saw 3; an input scored in time on either starts it again."""
    loc = RunLocation(tmp_path / "run")
    a, b = (Deadline("r", 0.05, 3, RunStreak(loc, look_every_s=0.0)) for _ in range(2))
    hang = lambda: time.sleep(5)  # noqa: E731
    assert a.call(hang, "i1") == (False, None) and b.call(hang, "i2") == (False, None)
    assert b.in_a_row == 2
    assert a.call(lambda: 7, "i3") == (True, 7)  # in time: the run's count starts again
    assert b.call(hang, "i4") == (False, None) and b.in_a_row == 1
    assert a.call(hang, "i5") == (False, None)
    with pytest.raises(RewardHungError, match="3 inputs in a row.*'i6'"):
        b.call(hang, "i6")
    c, d = (Deadline("r", 0.05, 3, RunStreak(RunLocation(tmp_path / "other"), look_every_s=0.0)) for _ in range(2))
    c.call(hang, "j1"), d.call(hang, "j2")
    with pytest.raises(RewardHungError, match="3 inputs in a row.*'j3'"):
        c.call(hang, "j3")  # c's own: 2


def test_a_batch_of_calls_is_one_handoff_and_a_hang_fails_only_its_input():
    """`call_many` hands every call to one runner thread at once; a call past the deadline
    fails its input, whose later calls are not made, and the calls after it still run (on a
    fresh thread, the hung one left behind)."""
    release = threading.Event()
    made: list[tuple[str, int]] = []
    threads: list[int] = []

    def fn(input_id: str, k: int, hang: bool = False):
        def call():
            made.append((input_id, k))
            threads.append(threading.get_ident())
            if hang:
                release.wait(30)
            return f"{input_id}/{k}"
        return call

    try:
        d = Deadline("r", 5.0, 2)
        calls = [(fn(i, k), i) for i in ("a", "b") for k in range(3)]
        assert d.call_many(calls) == [(True, f"{i}/{k}") for i in ("a", "b") for k in range(3)]
        assert len(set(threads)) == 1 and threads[0] != threading.get_ident()  # one handoff, off this thread

        made.clear(), threads.clear()
        slow = Deadline("r", 0.2, 2)
        calls = [(fn("a", 0), "a"), (fn("b", 0), "b"), (fn("b", 1, hang=True), "b"), (fn("b", 2), "b"),
                 (fn("c", 0), "c")]
        assert slow.call_many(calls) == [(True, "a/0"), (True, "b/0"), (False, None), (False, None), (True, "c/0")]
        assert made == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]  # b's third call never made
        assert threads[-1] != threads[0] and slow.in_a_row == 0  # c ran on a fresh thread, in time
        with pytest.raises(ZeroDivisionError):
            slow.call_many([(fn("d", 0), "d"), (lambda: 1 / 0, "e")])
    finally:
        release.set()
