"""flexmarl_core.analysis.shortfall: the factors of a wall-time shortfall, a helper's per-token cost read from
a run's op log, and the machine's parallel efficiency measured in real processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from flexmarl_core.analysis import shortfall


def _run(tmp_path: Path) -> Path:
    metrics = tmp_path / "metrics"
    metrics.mkdir(parents=True)
    decisions = [{"decision": "gradient_helper", "agent": "solver", "iteration": 0, "mb": 1},
                 {"decision": "move_instance", "agent": "solver", "iteration": 0}]
    ops = [
        # the trainer's own: 2.0 CPU-s for 1000 tokens; the helper: 1.1 CPU-s for 500
        {"kind": "train", "agent": "solver", "iteration": 0, "mb": 0, "cpu_s": 2.0, "tokens": 1000},
        {"kind": "train", "agent": "solver", "iteration": 0, "mb": 1, "cpu_s": 1.1, "tokens": 500},
        # a retried op found its work done: not a cost of either kind
        {"kind": "train", "agent": "solver", "iteration": 0, "mb": 1, "cpu_s": 0.3, "tokens": 0, "skipped": True},
        {"kind": "train", "agent": "planner", "iteration": 0, "mb": 0, "cpu_s": 0.5, "tokens": 100},
        {"kind": "rollout", "agent": "solver", "iteration": 0, "mb": 1, "cpu_s": 9.0, "tokens": 800},
        {"kind": "step", "agent": "solver", "iteration": 0, "mb": None, "cpu_s": 0.2, "tokens": 0},
    ]
    (metrics / "decisions.jsonl").write_text("\n".join(json.dumps(d) for d in decisions))
    (metrics / "ops.jsonl").write_text("\n".join(json.dumps(o) for o in ops))
    return tmp_path


def test_helper_cost_compares_helper_and_trainer_ops_of_one_agent(tmp_path):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    cost = shortfall.helper_cost([a])
    assert set(cost["token_cost"]) == {"solver"}  # the planner had no helper
    assert math.isclose(cost["token_cost"]["solver"], (1.1 / 500) / (2.0 / 1000), rel_tol=1e-12)
    # 1.1 CPU-s for 500 tokens where the trainer's rate gives 1.0: 0.1 of 13.1 CPU-s of stages
    assert math.isclose(cost["excess_frac"], 0.1 / 13.1, rel_tol=1e-9)
    # two repeats: sums of CPU and tokens over both, not a mean of per-run ratios
    cost2 = shortfall.helper_cost([a, b])
    assert math.isclose(cost2["token_cost"]["solver"], cost["token_cost"]["solver"], rel_tol=1e-12)
    assert math.isclose(cost2["excess_frac"], cost["excess_frac"], rel_tol=1e-9)


def test_decompose_gives_the_factors_and_the_machine_ceiling():
    res = {"speedup": 1.90 * 0.9 * 0.96, "speedup_bound": 1.90,
           "stage_time_ratio_sync_over_codesign": 0.9, "floor_frac_codesign": 0.96}
    out = shortfall.decompose(res, {"median": 0.94}, {"median": 0.90},
                              {"token_cost": {"solver": 1.08}, "excess_frac": 0.02})
    assert out["helper_token_cost"] == {"solver": 1.08} and out["helper_excess_frac"] == 0.02
    assert math.isclose(out["parallel_efficiency"]["mean"], 0.92, rel_tol=1e-12)
    assert math.isclose(out["speedup_ceiling_machine"], 1.90 * 0.92, rel_tol=1e-12)
    assert math.isclose(out["speedup_frac_of_machine_ceiling"], res["speedup"] / (1.90 * 0.92), rel_tol=1e-12)
    # without a measurement there is no ceiling to report, rather than a made-up one
    assert "speedup_ceiling_machine" not in shortfall.decompose(res, None, None, {})


def test_parallel_efficiency_runs_two_real_processes():
    res = shortfall.parallel_efficiency("tiny-1m", steps=1, rounds=1)
    assert len(res["per_round"]) == 1
    # one process alone / the mean of two at once: finite and positive (two runs that never
    # overlapped, or one that never ran, would not give a number at all)
    assert 0.0 < res["median"] < 10.0
