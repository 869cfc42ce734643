"""Per-agent training statistics reach `iterations.jsonl` and TensorBoard while the run goes
on: each iteration's row is written once its figures are final, not after the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver import run
from flexmarl_core.ops import OpRecord
from flexmarl_core.orchestrator.hooks import Callbacks
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn

REPO = Path(__file__).resolve().parents[2]
AGENTS = ("planner", "solver", "verifier")
STATS = ("reward", "train/loss", "train/pg_loss", "train/clip_frac", "train/entropy", "train/grad_norm")


def test_iteration_rows_are_live_and_carry_per_agent_statistics(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"run_dir={tmp_path}/run", "train.iterations=3", "workload.reward=tests.reward_fns:varied",
        "workload.credit=team",
    ])
    run_dir = run.prepare_run(cfg)
    rows_seen: list[tuple[int, int]] = []  # (ops done, iteration rows on disk) after each op

    def on_done(rec: OpRecord) -> None:
        path = run_dir / "metrics" / "iterations.jsonl"
        n = len(path.read_text().splitlines()) if path.exists() else 0
        rows_seen.append((len(rows_seen) + 1, n))

    # One worker: two threads building models at once trip transformers (meta-device init).
    ex = ThreadExecutor(stage_fn(str(run_dir)), {"w0": {"rollout": 1, "train": 1}})
    try:
        out = run.train(cfg, run_dir, ex, hooks=[Callbacks(on_done)])
    finally:
        ex.close()
    total = out.ops
    # Iteration 0's row was on disk while later iterations still had ops to run.
    first = next(k for k, n in rows_seen if n >= 1)
    assert first < total - 5, rows_seen[-10:]
    rows = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows == out.iterations
    for r in rows:
        for a in AGENTS:
            for s in STATS:
                assert f"agent/{a}/{s}" in r, (a, s)
            assert r[f"agent/{a}/train/grad_norm"] > 0
            # per-token means of a sampled-token NLL: positive, below the uniform bound log(V)
            assert 0 < r[f"agent/{a}/train/entropy"] < 12
            assert 0 <= r[f"agent/{a}/train/clip_frac"] <= 1

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "metrics" / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("agent/solver/train/loss")]
    assert steps == [0, 1, 2]


def test_tracker_rows_equal_a_full_scan_of_every_record():
    """The tracker keeps only the records that can still overlap a window; its rows must be
    exactly (==, floats included) those of `iteration_metrics` over every record, with
    iterations whose ops overlap (async pipeline) and a worker idle in later iterations."""
    import random

    from flexmarl_core.driver.metrics import IterationTracker, iteration_metrics
    from flexmarl_core.ops import Op, StageResult

    rng = random.Random(0)
    recs, t = [], 100.0
    sizes = {}
    for it in range(12):
        ops = [Op(it, "rollout", "solver", mb=j) for j in range(3)] + [Op(it, "reward", mb=0), Op(it, "step", "solver")]
        sizes[it] = len(ops)
        for op in ops:
            t0 = t + rng.uniform(-0.5, 0.3)  # starts before the previous op ended: overlap
            t1 = t0 + rng.uniform(0.05, 1.0)
            worker = "w2" if it < 2 else rng.choice(["w0", "w1"])
            recs.append(OpRecord(op, t0, t1, StageResult(op, worker=worker, t_start=t0, t_end=t1,
                                                         tokens=rng.randint(1, 50), cpu_s=t1 - t0,
                                                         metrics={"team/accuracy": rng.random()})))
            t = t1
    rows: list[dict] = []
    seen: list[OpRecord] = []
    expected: list[dict] = []  # the full scan over every record taken when the row is emitted

    def emit(row: dict) -> None:
        it = row["iteration"]
        prev = (min(r.result.t_start for r in seen) if it == 0 else
                max(r.result.t_end for r in seen if r.op.iteration == it - 1))
        expected.append(iteration_metrics(list(seen), [], it, prev))
        rows.append(row)

    # Taken in about the order they end, as the flow sees completions: some op of the next
    # iteration, still running at this one's end, is taken before this one's last op.
    recs.sort(key=lambda r: r.result.t_end + rng.uniform(0, 0.6))
    tracker = IterationTracker(sizes, emit)
    for r in recs:
        seen.append(r)
        tracker.add(r, None, [])
    tracker.flush(final=True)
    assert [r["iteration"] for r in rows] == list(range(12))
    assert rows == expected
    assert len(tracker._live) < len(recs) / 4  # it does prune


def test_a_resume_after_a_repair_keeps_the_rows_written_and_no_window_goes_negative():
    """A repair rewound one op of iteration 1, which runs again after a resume, long after the
    earlier attempt's last op. Rows the earlier attempt wrote stand (iteration 1's is only
    said to be rebuilt, once its op is done); an iteration it finished but did not report,
    which ended before iteration 1's rerun op, still gets a window of its own time (the bug:
    1e-09 s, an absurd rate, utilisation 0); the earlier attempt's time is the run's."""
    from flexmarl_core.driver.metrics import IterationTracker
    from flexmarl_core.ops import Op, StageResult

    def rec(it: int, mb: int, t0: float, t1: float) -> OpRecord:
        op = Op(it, "rollout", "solver", mb=mb)
        return OpRecord(op, t0, t1, StageResult(op, worker="w0", t_start=t0, t_end=t1, tokens=10))

    earlier = [rec(0, 0, 0, 1), rec(0, 1, 1, 2), rec(1, 0, 2, 3), rec(2, 0, 4, 5), rec(2, 1, 5, 6)]
    again = rec(1, 1, 100.5, 101)  # iteration 1's rewound op, run again after the resume
    sizes = {0: 2, 1: 2, 2: 2}
    for reported in ([0, 1, 2], [0]):
        first = IterationTracker(sizes, lambda row: None)
        for r in [*earlier[:3], rec(1, 1, 3, 4), *earlier[3:]]:
            first.add(r, None, [])
        rows = [r for r in first.rows if r["iteration"] in reported]
        emitted, rebuilt = [], []
        tracker = IterationTracker(sizes, emitted.append, rebuilt=rebuilt.append)
        tracker.resume(earlier, [{**r, "rebuilt_ops": 1} if r["iteration"] == 1 else r for r in rows], resumed_at=100)
        tracker.add(again, None, [])
        tracker.flush(final=True)
        if reported == [0, 1, 2]:
            assert emitted == [] and [r["iteration"] for r in rebuilt] == [1]
            assert tracker.rows[0] == first.rows[0] and tracker.earlier_s == sum(r["e2e_s"] for r in first.rows)
            continue
        assert [r["iteration"] for r in emitted] == [1, 2] and rebuilt == []
        one, two = emitted
        assert one["e2e_s"] == pytest.approx(6 - 2 + 1)  # 2..6 before the kill, 100..101 after
        assert two["e2e_s"] == pytest.approx(6 - 2)  # from iteration 0's end, not from 101
        for r in emitted:
            assert 0 < r["utilization"] <= 1 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["e2e_s"])
        assert tracker.earlier_s == pytest.approx(6)
