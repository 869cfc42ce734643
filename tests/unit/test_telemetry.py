"""Where a step goes (driver/telemetry.py): the shares, the step's and the sync's seconds, the
pipeline's rollout wait and queue depth from op times, and the summary's block of medians."""

from __future__ import annotations

import pytest

from flexmarl_core.driver.metrics import IterationTracker
from flexmarl_core.driver.telemetry import (
    Pipeline,
    op_seconds,
    queue_bound,
    shares,
    step_lines,
    where_a_step_goes,
)
from flexmarl_core.ops import Op, OpRecord, StageResult


def rec(op: Op, t0: float, t1: float, worker: str = "w0", **metrics: float) -> OpRecord:
    m = {f"agent/{op.agent}/{k}": v for k, v in metrics.items()}
    if op.kind == "reward":
        m["team/accuracy"] = 0.5
    return OpRecord(op, t0, t1, StageResult(op, worker=worker, t_start=t0, t_end=t1, tokens=1, metrics=m))


def deps(op: Op) -> list[Op]:
    """A train op waits for its micro-batch's reward, a reward for the micro-batch's rollout."""
    if op.kind == "train":
        return [Op(op.iteration, "reward", mb=op.mb)]
    return [Op(op.iteration, "rollout", "solver", mb=op.mb)] if op.kind == "reward" else []


def two_iterations() -> list[OpRecord]:
    """One agent, two micro-batches, iterations 0 and 1; iteration 1's first rollout starts
    while iteration 0 trains (one iteration ahead), and its second micro-batch trains on a
    gradient helper (another worker, not the agent's trainer)."""
    return [
        rec(Op(0, "rollout", "solver", mb=0), 0.0, 2.0), rec(Op(0, "reward", mb=0), 2.0, 2.5),
        rec(Op(0, "rollout", "solver", mb=1), 2.0, 5.0, "w1"), rec(Op(0, "reward", mb=1), 5.0, 5.5),
        rec(Op(0, "train", "solver", mb=0), 3.0, 4.0),  # free since the run began (0), data at 2.5
        rec(Op(1, "rollout", "solver", mb=0), 2.8, 10.0, "w1"),  # started before iteration 0 trained
        rec(Op(0, "train", "solver", mb=1), 6.0, 7.0),  # free at 4, data at 5.5
        rec(Op(0, "step", "solver"), 7.0, 7.5), rec(Op(0, "sync", "solver"), 7.5, 8.0),
        rec(Op(1, "reward", mb=0), 10.0, 10.2), rec(Op(1, "rollout", "solver", mb=1), 8.5, 11.0, "w1"),
        rec(Op(1, "reward", mb=1), 11.0, 11.2),
        rec(Op(1, "train", "solver", mb=0), 10.5, 11.0),  # free at 8 (the sync), data at 10.2
        rec(Op(1, "train", "solver", mb=1), 11.3, 11.8, "w1", **{"train/helper_bytes": 64.0}),
        rec(Op(1, "step", "solver"), 12.0, 12.5), rec(Op(1, "sync", "solver"), 12.5, 13.0),
    ]


def test_shares_divide_per_agent_counts_and_skip_an_empty_whole():
    sums = {"agent/a/train/tokens_padded": 3.0, "agent/a/train/tokens_cells": 12.0,
            "agent/a/rollout/prefill_s": 0.5, "agent/a/rollout/generate_s": 2.0,
            "agent/a/train/tokens_shared": 6.0, "agent/a/train/tokens_sample": 24.0,
            "agent/b/train/tokens_padded": 0.0, "agent/b/train/tokens_cells": 0.0}
    assert shares(sums) == {"agent/a/train/padding_share": 0.25, "agent/a/rollout/prefill_share": 0.25,
                            "agent/a/train/shared_share": 0.25}


def test_op_seconds_are_the_step_and_sync_ops_own():
    recs = two_iterations()
    assert op_seconds([r for r in recs if r.op.iteration == 0]) == {
        "agent/solver/train/step_s": 0.5, "agent/solver/sync/weight_sync_s": 0.5}


def test_queue_bound_only_where_rollouts_may_run_ahead():
    assert queue_bound(False, 0) is None
    assert queue_bound(True, 0) == 0 and queue_bound(False, 2) == 2 and queue_bound(True, 1) == 1


def test_pipeline_waits_and_queue_depth_through_the_tracker():
    rows: list[dict] = []
    recs = two_iterations()
    tracker = IterationTracker({0: 8, 1: 8}, rows.append, pipeline=Pipeline(deps, bound=1))
    for r in sorted(recs, key=lambda r: r.result.t_end):
        now = r.result.t_end  # as the orchestrator says it: the earliest submit still running
        running = [x.submitted for x in recs if x.submitted <= now < x.result.t_end]
        tracker.add(r, min(running, default=None), [])
    tracker.flush(final=True)
    assert [r["iteration"] for r in rows] == [0, 1]
    zero, one = rows
    assert zero["agent/solver/train/rollout_wait_s"] == pytest.approx(2.5 + 1.5)
    assert zero["pipeline/rollout_wait_s"] == pytest.approx(4.0)
    # the helper's micro-batch is not the trainer's: only micro-batch 0 waited (10.2 - 8)
    assert one["pipeline/rollout_wait_s"] == pytest.approx(2.2)
    assert (zero["pipeline/queue_depth"], one["pipeline/queue_depth"]) == (1.0, 0.0)
    assert zero["pipeline/queue_bound"] == one["pipeline/queue_bound"] == 1.0
    assert one["agent/solver/train/step_s"] == pytest.approx(0.5)
    # what was kept for the emitted iterations is gone, but for the trainer's last step
    p = tracker.pipeline
    assert not p._trains and not p._data_end and not p._gen_start
    assert p._trainer["solver"] == [(12.0, 12.5, 1), (12.5, 13.0, None)]


def test_a_tracker_without_a_pipeline_adds_nothing_and_downtime_is_no_wait():
    rows: list[dict] = []
    tracker = IterationTracker({0: 8, 1: 8}, rows.append)
    for r in two_iterations():
        tracker.add(r, None, [])
    tracker.flush(final=True)
    assert not any(k.startswith("pipeline/") or k.endswith("rollout_wait_s") for r in rows for k in r)
    p = Pipeline(deps)  # no bound: no queue figures
    for r in two_iterations():
        p.take(r)
    assert p.figures(0, 0.0) == {"agent/solver/train/rollout_wait_s": pytest.approx(4.0),
                                 "pipeline/rollout_wait_s": pytest.approx(4.0)}
    # the run was down from 8.5 to 9.5 (a resume): that second is nobody's wait
    assert p.figures(1, 0.0, [(8.5, 9.5)])["pipeline/rollout_wait_s"] == pytest.approx(1.2)


def test_the_block_is_medians_and_its_lines_name_each_figure():
    per_it = [{"iteration": i, "e2e_s": 1.0, "agent/solver/train/step_s": s, "agent/solver/staleness": 1.0,
               "agent/solver/train/padding_share": 0.1, "agent/solver/reward": 0.5,
               "pipeline/queue_depth": d, "pipeline/queue_bound": 1.0}
              for i, (s, d) in enumerate([(0.1, 1.0), (0.3, 0.0), (0.2, 1.0)])]
    per_it[0]["agent/solver/rollout/prefill_share"] = 0.4  # one iteration has it: its median is it
    block = where_a_step_goes(per_it)
    assert block == {"agent/solver/rollout/prefill_share": 0.4, "agent/solver/staleness": 1.0,
                     "agent/solver/train/padding_share": 0.1, "agent/solver/train/step_s": 0.2,
                     "pipeline/queue_bound": 1.0, "pipeline/queue_depth": 1.0}
    lines = step_lines(block)
    assert lines[0].startswith("where a step goes")
    assert lines[1] == "  solver: step 0.200 s, padding 10%, prefill 40% of decoding, staleness 1.00"
    assert lines[2] == "  pipeline: rollouts 1 iteration(s) ahead of training (bound 1)"
    assert step_lines({}) == [] and where_a_step_goes([]) == {}
