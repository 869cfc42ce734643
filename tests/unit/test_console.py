"""The terminal output of a run: one line per iteration with its figures (at a terminal and in a
log alike), and bars that stay few however long the run (rich redraws every bar it holds at each
refresh, so keeping all of them made a long run's display cost grow with it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver.console import IterationProgress, iteration_line
from flexmarl_core.driver.metrics import IterationTracker
from flexmarl_core.ops import OpRecord, StageResult, agent_key
from flexmarl_core.orchestrator.plan import Plan

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "default.yaml")


def _plan(iterations: int) -> Plan:
    cfg = load_config(DEFAULT, [f"train.iterations={iterations}"])
    return Plan.build(cfg)


def _rec(op) -> OpRecord:
    return OpRecord(op=op, submitted=0.0, finished=0.0, result=StageResult(op=op))


def test_only_running_iterations_and_the_last_finished_keep_a_bar():
    plan = _plan(12)
    ops = list(plan.deps)  # dependency order: iterations one after another
    with IterationProgress(plan, terminal=True) as bar:
        most = 0
        for op in ops:
            bar(_rec(op))
            most = max(most, len(bar.progress.tasks))
        shown = {t.fields["it"]: t for t in bar.progress.tasks}
    # Never more than the iteration being run and the one finished before it.
    assert most == 2
    assert list(shown) == [11] and shown[11].completed == plan.sizes()[11]


def test_overlapping_iterations_each_keep_a_bar_until_they_end():
    plan = _plan(6)
    by_it: dict[int, list] = {}
    for op in plan.deps:
        by_it.setdefault(op.iteration, []).append(op)
    # Three iterations in flight at once (as with async pipelining), their ops interleaved.
    half = len(by_it[0]) // 2
    order = [op for trio in zip(by_it[0][:half], by_it[1][:half], by_it[2][:half], strict=True) for op in trio]
    with IterationProgress(plan, terminal=True) as bar:
        for op in order:
            bar(_rec(op))
        assert sorted(t.fields["it"] for t in bar.progress.tasks) == [0, 1, 2]
        for it in (0, 1, 2):
            for op in by_it[it][half:]:
                bar(_rec(op))
        assert [t.fields["it"] for t in bar.progress.tasks] == [2]
        bar(_rec(by_it[0][0]))  # an op run again after its iteration ended: no bar comes back
        assert [t.fields["it"] for t in bar.progress.tasks] == [2]


AGENTS = ("planner", "solver", "verifier")


def _timed_records(plan: Plan) -> list[OpRecord]:
    """Every op of `plan` in dependency order, 0.5 s each on alternating workers of a made-up
    clock; each reward op scores the team 0.5 and agent i `0.25 * (i + 1)` (the iteration's
    row then holds exactly those means)."""
    recs, t = [], 100.0
    for i, op in enumerate(plan.deps):
        metrics = {}
        if op.kind == "reward":
            metrics = {"team/accuracy": 0.5, **{agent_key(a, "reward"): 0.25 * (j + 1) for j, a in enumerate(AGENTS)}}
        res = StageResult(op=op, worker=f"w{i % 2}", t_start=t, t_end=t + 0.5, metrics=metrics)
        recs.append(OpRecord(op=op, submitted=t, finished=t + 0.5, result=res))
        t += 0.5
    return recs


LINE = re.compile(r"^iteration (\d+)/(\d+)  E2E (\d+\.\d\d) s  acc (\d\.\d{3})  util (\d\.\d\d)  "
                  r"reward planner (\d\.\d{3}) solver (\d\.\d{3}) verifier (\d\.\d{3})$")


@pytest.mark.parametrize("terminal", [True, False])
def test_each_iteration_prints_its_figures_in_one_line(capsys, terminal):
    """At a terminal and in a log or pipe alike: `iteration 1/2  E2E ... s  acc ...  util ...
    reward <agent> ...`, one line per iteration as its row becomes final, counted from 1."""
    plan = _plan(2)
    rows: list[dict] = []
    with IterationProgress(plan, terminal=terminal) as bar:
        assert bar.progress.disable is not terminal
        tracker = IterationTracker(plan.sizes(), lambda row: (rows.append(row), bar.iteration(row)), lambda: 2)
        for rec in _timed_records(plan):
            bar(rec)
            tracker.add(rec, None, [])
    # (At a terminal rich also draws the last bar, `iteration 2/2 ━━━ 34/34`, as the display ends.)
    lines = [line for line in capsys.readouterr().out.splitlines() if "  E2E " in line]
    assert [m["iteration"] for m in rows] == [0, 1] and len(lines) == 2
    for line, m in zip(lines, rows, strict=True):
        got = LINE.match(line)
        assert got, line
        n, of, e2e, acc, util, *rewards = got.groups()
        assert (int(n), int(of)) == (m["iteration"] + 1, 2)
        # Each iteration's window: its ops back to back, 0.5 s each, one worker busy at a time.
        assert float(e2e) == pytest.approx(0.5 * plan.sizes()[m["iteration"]], abs=0.005)
        assert float(acc) == 0.5 and float(util) == pytest.approx(0.5, abs=0.005)
        assert [float(r) for r in rewards] == [0.25, 0.5, 0.75]
        assert line == iteration_line(m, 2) and len(line) <= 100


def test_an_iteration_line_without_agent_rewards_says_so_by_leaving_them_out():
    m = {"iteration": 9, "e2e_s": 12.345, "accuracy": 1.0, "utilization": 0.954}
    assert iteration_line(m, 10) == "iteration 10/10  E2E 12.35 s  acc 1.000  util 0.95"


def test_failed_trajectories_and_a_rebuilt_row_show_on_the_line_and_in_the_summary():
    from flexmarl_core.driver.console import summary_lines, summary_table
    from flexmarl_core.driver.metrics import run_summary

    rows = [{"iteration": 0, "e2e_s": 1.0, "tokens": 10, "tokens_per_s": 10.0, "accuracy": 0.5, "utilization": 0.5,
             "failed_trajectories": 2.0},
            {"iteration": 1, "e2e_s": 1.0, "tokens": 10, "tokens_per_s": 10.0, "accuracy": 0.5, "utilization": 0.5,
             "failed_trajectories": 0.0, "rebuilt_ops": 3}]
    assert iteration_line(rows[0], 2).endswith("util 0.50  failed trajectories 2")
    assert "failed" not in iteration_line(rows[1], 2) and "rebuilt after a store repair: 3 ops" in iteration_line(rows[1], 2)
    s = {**run_summary(rows, 5.0), "attempt_wall_s": 1.5, "prefect_overhead_frac": 0.0, "run_dir": "r"}
    assert s["failed_trajectories"] == 2
    lines = summary_lines(s)
    assert any(x.startswith("failed trajectories: 2") for x in lines), lines
    assert any("5.0 s of running in all, 1.5 s of them in this attempt" in x for x in lines), lines
    assert "failed" in [c.header for c in summary_table(rows, s).columns]
