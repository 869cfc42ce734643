"""The terminal progress display: its bars stay few however long the run (rich redraws every bar
it holds at each refresh, so keeping all of them made a long run's display cost grow with it)."""

from __future__ import annotations

from pathlib import Path

from flexmarl.console import IterationProgress
from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from flexmarl_core.ops import OpRecord, StageResult
from flexmarl_core.plan import Plan

DEFAULT = str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")


def _plan(iterations: int) -> Plan:
    cfg = load_config(DEFAULT, [f"train.iterations={iterations}"])
    return Plan.build(cfg, MEG.from_config(cfg.team))


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


def test_no_bars_off_a_terminal_but_a_line_per_finished_iteration(capsys):
    plan = _plan(2)
    with IterationProgress(plan, terminal=False) as bar:
        assert bar.progress.disable
        for op in plan.deps:
            bar(_rec(op))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration ")]
    assert [line.split(":")[0] for line in lines] == ["iteration 0", "iteration 1"]
    assert f"{plan.sizes()[0]} ops done" in lines[0]
