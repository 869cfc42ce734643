"""The run report's text charts and tables, without a Prefect API (tests/stack/test_faults.py checks
the published artifacts of a real flow run)."""

from __future__ import annotations

from tasks.report import decision_table, iteration_rows, sparkline, summary_markdown, text_charts


def _per_it(n: int) -> list[dict]:
    return [{"iteration": i, "e2e_s": 2.0, "tokens": 10 * (i + 1), "tokens_per_s": 5.0 * (i + 1),
             "utilization": 0.5, "accuracy": 0.0, "agent/solver/reward": 0.1 * i, "agent/planner/reward": 0.2,
             "stage_s/rollout": 1.0, "balance_moves": 0, "train_swaps": 1} for i in range(n)]


def test_sparkline_scale_and_flat_series():
    assert sparkline([0.0, 0.5, 1.0], 0.0, 1.0) == "▁▅█"
    assert sparkline([3.0, 3.0], 3.0, 3.0) == "▅▅"  # no range: mid-height, no division by zero


def test_text_charts_bars_per_iteration_then_sparkline_for_long_runs():
    chart = text_charts(_per_it(3), width=20)
    bars = [ln for ln in chart.splitlines() if ln.startswith("it ")]
    assert [ln.count("█") for ln in bars] == [7, 13, 20]  # proportional to tokens/s, max = width
    assert "15.0 tokens/s" in chart and "└" in chart
    assert any(ln.startswith("planner") for ln in chart.splitlines())
    long = text_charts(_per_it(100), max_bar_rows=40)
    assert not any(ln.startswith("it ") for ln in long.splitlines())
    assert any(ln.startswith("tokens/s") and len(ln.split()[1]) == 100 for ln in long.splitlines())
    assert text_charts([]) == "(no iterations)"


def test_tables_and_summary():
    rows = iteration_rows(_per_it(2))
    assert list(rows[0])[:8] == ["iteration", "e2e_s", "tokens", "tokens_per_s", "utilization",
                                 "accuracy", "agent/planner/reward", "agent/solver/reward"]
    cols = decision_table([{"t": 0.0, "decision": "move_instance", "loads": {"a": 1}, "decide_us": 3.0}])
    assert cols["t"] == ["1970-01-01T00:00:00.000+00:00"] and cols["loads"] == ['{"a": 1}']
    assert cols["decide_us"] == [3.0] and cols["agent"] == [None]
    assert decision_table([])["decision"] == []  # columns even without rows
    md = summary_markdown("x", _per_it(2), {"run_dir": "/r", "wall_s": 1.23456, "critical_path": {"wait_s": 0.5}}, "/r/store")
    assert "- run folder: `.../r`" in md and "- wall_s: 1.235" in md and "- critical_path:\n  - wait_s: 0.5" in md
