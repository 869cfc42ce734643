"""A run's plan is extended as the run goes and what the flow keeps per op is forgotten once no
op still to come can refer to it: the orchestrator's state, the control plane's, the critical
path's and the iteration tracker's stay the size of a few iterations over a run of any length
(issue: flat memory over long runs). Real orchestrator on the in-process ThreadExecutor."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl_core.config import config_from_dict
from flexmarl_core.driver.metrics import CriticalPath, IterationTracker, critical_path
from flexmarl_core.ops import Op, OpRecord, StageResult
from flexmarl_core.orchestrator.hooks import Callbacks
from flexmarl_core.orchestrator.loop import Orchestrator
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.sim.threads import ThreadExecutor
from tests.unit.test_orchestrator import TEAM, WORKERS

REPO = Path(__file__).resolve().parents[2]
PER_ITERATION = 3 * 2 + 2 + 3 * 2 + 3 + 3  # rollouts, rewards, train, step, sync: 2 micro-batches


def cfg_of(iterations: int, **codesign):
    stale = codesign.get("max_staleness", 0) > 0
    agents = [{**a, "algorithm": {"policy_loss": "decoupled_ppo"}} if stale else a for a in TEAM["agents"]]
    return config_from_dict({
        "team": {**TEAM, "agents": agents}, "codesign": codesign, "train": {"iterations": iterations},
        "batch": {"inputs_per_iteration": 4, "micro_batch_inputs": 2},
    })


def _stage(op: Op, worker: str, gradient_only: bool = False) -> StageResult:
    return StageResult(op, worker=worker, t_start=0.0, t_end=0.0)


class Sizes:
    """The most entries each per-op structure of the flow held after any op ended."""

    def __init__(self) -> None:
        self.orch: Orchestrator | None = None
        self.most: dict[str, int] = {}

    def __call__(self, rec) -> None:
        o = self.orch
        st = o.state
        now = {"plan": len(o.plan.deps), "waiting": len(st.waiting), "children": len(st.children),
               "recorded": len(st.recorded), "skip": len(o.skip), "order": len(o._order),
               "resubmits": len(o._resubmits), "completed": len(o.control.ledger.completed)}
        for k, v in now.items():
            self.most[k] = max(self.most.get(k, 0), v)


def run_windowed(cfg, skip=()):
    """Run `cfg` with a windowed plan; (the ops run in order, the most held per structure, the
    critical path kept as it went, the records)."""
    plan = Plan.build(cfg, window=1)
    sizes = Sizes()
    path = CriticalPath(plan.deps_of, plan.sizes(), plan.reach)
    done: list = []
    ex = ThreadExecutor(_stage, WORKERS)
    try:
        orch = Orchestrator(plan, cfg, ex, skip=skip, hooks=[Callbacks(lambda r: (done.append(r), path.add(r), sizes(r)))])
        sizes.orch = orch
        res = orch.run()
    finally:
        ex.close()
    return done, sizes.most, path, res


@pytest.mark.parametrize("codesign", [{}, {"max_staleness": 1}, {"async_pipeline": False, "dependency_parallel": False}])
def test_state_stays_a_few_iterations_whatever_the_run_length(codesign):
    """10 iterations or 40: no structure holds more than (reach + 2) iterations' ops; each op runs
    once, after its dependencies (checked against the whole plan)."""
    most = {}
    for n in (10, 40):
        cfg = cfg_of(n, **codesign)
        done, most[n], _, res = run_windowed(cfg)
        whole = Plan.build(cfg)
        assert sorted(r.op for r in done) == sorted(whole.ops()) and res.ops == len(whole.ops())
        at = {r.op: i for i, r in enumerate(done)}
        assert all(at[d] < at[op] for op, ds in whole.deps.items() for d in ds)
        bound = (whole.reach + 2) * PER_ITERATION  # whatever n is
        assert all(v <= bound for v in most[n].values()), (n, most[n], bound)


@pytest.mark.parametrize("config", ["configs/default.yaml", "configs/program_team.yaml", "configs/tool_team.yaml"])
def test_a_windowed_plan_is_the_whole_plan_one_iteration_at_a_time(config):
    """Extended to the end, a plan built two iterations ahead has the whole plan's ops and
    dependencies in the same order, and its sizes were known from the start."""
    from flexmarl_core.config import load_config

    cfg = load_config(str(REPO / config), ["train.iterations=7"])
    whole, windowed = Plan.build(cfg), Plan.build(cfg, window=2)
    assert windowed.sizes() == whole.sizes() and len(windowed.deps) == sum(whole.sizes()[i] for i in (0, 1))
    made = dict(windowed.deps)
    for it in range(2, 7):
        new = windowed.extend(it)
        assert new == windowed.iteration_ops(it) and len(new) == whole.sizes()[it]
        made.update({op: windowed.deps[op] for op in new})
        windowed.forget(it - 1)
    assert list(made.items()) == list(whole.deps.items())
    assert set(windowed.deps) == {op for op in whole.deps if op.iteration >= 5}


def test_a_resumed_run_admits_only_what_is_left():
    """Resuming after 25 of 30 iterations plus part of the 26th runs exactly the rest, and holds
    no more than a fresh run does."""
    cfg = cfg_of(30, max_staleness=1)
    whole = Plan.build(cfg)
    order = [r.op for r in run_windowed(cfg)[0]]
    cut = next(i for i, op in enumerate(order) if op.iteration == 26) + 5
    done, most, _, _ = run_windowed(cfg, skip=order[:cut])
    assert sorted(r.op for r in done) == sorted(set(whole.ops()) - set(order[:cut]))
    assert all(v <= (whole.reach + 2) * PER_ITERATION for v in most.values()), most


def test_critical_path_kept_as_it_goes_is_the_one_walked_back():
    """The path folded in op by op (with its summaries dropped behind the window) is the one
    `critical_path` walks back from the last op over every record and the whole plan."""
    cfg = cfg_of(12, max_staleness=1)
    plan = Plan.build(cfg)
    # Real times, so the gates differ: each op ends a little after the latest dependency.
    ends: dict[Op, float] = {}
    recs = []
    for i, op in enumerate(plan.ops()):
        start = max((ends[d] for d in plan.deps[op]), default=0.0) + 0.01 * (i % 3)
        ends[op] = start + 0.1 + 0.05 * (i % 7)
        recs.append(OpRecord(op, start - 0.02 * (i % 2), ends[op], StageResult(op, worker="w0", t_start=start, t_end=ends[op])))
    path = CriticalPath(Plan.build(cfg, window=1).deps_of, plan.sizes(), plan.reach)
    for r in recs:
        path.add(r)
    want = critical_path(recs, plan.deps)
    got = path.summary()
    assert got.keys() == want.keys() and got["ops"] == want["ops"]
    assert all(got[k] == pytest.approx(want[k], rel=1e-9) for k in want)  # sums in another order


def test_the_tracker_keeps_only_iterations_not_emitted():
    rows = []
    cfg = cfg_of(8)
    plan = Plan.build(cfg)
    tracker = IterationTracker(plan.sizes(), rows.append)
    for i, op in enumerate(plan.ops()):
        metrics = {"team/accuracy": 0.5} if op.kind == "reward" else {}
        tracker.add(OpRecord(op, i, i + 1.0, StageResult(op, worker="w0", t_start=float(i), t_end=i + 1.0,
                                                         metrics=metrics)), None, [])
        assert len(tracker._by_it) <= 2
    assert [r["iteration"] for r in rows] == list(range(8)) and not tracker._by_it
