"""Estimator scope is a rule of the plan: every registered advantage estimator, with the async
pipeline on and off, on a graph team and a program team, runs a real iteration whose train ops
read exactly the samples their plan waited for.

The executor here is adversarial about order: a micro-batch's rewarding op (a graph team's
`reward`, a program team's `program`) after the first is held until nothing else is in flight,
so any train op the plan lets start before those rewards are in does start before them. A
batch-scoped estimator (`reinforce_pp`) whose train ops waited only for their own micro-batch
would then read half an iteration and fail the run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest

from flexmarl_core.algorithms import ADVANTAGES, advantage_scope
from flexmarl_core.config import ConfigError, load_config
from flexmarl_core.driver import run
from flexmarl_core.ops import Op, Route, StageResult
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
from storage import MEGStore

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"graph": REPO / "configs" / "tiny.yaml", "program": REPO / "configs" / "program_team.yaml"}
AGENTS = ("planner", "solver", "verifier")
SMALL = ["train.iterations=1", "batch.inputs_per_iteration=4", "batch.micro_batch_inputs=2",
         "batch.group_size=2", "train.warm_start=none", "train.evaluate_initial=false",
         "train.evaluate=false", "cluster.look_ahead=false", "cluster.fuse_chains=false"]


class RewardsLast(ThreadExecutor):
    """A thread executor that runs each micro-batch's rewarding op after the first only once
    every other op in flight has ended (the orchestrator waits on nothing else)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(stage_fn(str(run_dir)), {"w0": {"rollout": 1, "train": 1}})
        self.held: dict[Future, tuple[Op, threading.Event]] = {}
        #: ops in the order they started
        self.started: list[Op] = []

    def _run(self, op: Op, candidates: list[str], after: Sequence[Future] = (),
             gradient_only: bool = False) -> StageResult:
        self.started.append(op)
        return super()._run(op, candidates, after, gradient_only)

    def submit(self, op: Op, route: Route, deps: Sequence[Op] = (), after: Sequence[Future] = ()) -> Future:
        if op.kind not in ("reward", "program") or op.mb < 1:
            return super().submit(op, route, deps, after)
        gate = threading.Event()
        candidates = self._pick(route)

        def held() -> object:
            gate.wait()
            return self._run(op, candidates, after, route.gradient_only)

        fut = self.pool.submit(held)
        self.held[fut] = (op, gate)
        return fut

    def close(self) -> None:
        for _, gate in self.held.values():  # a run that failed leaves ops held
            gate.set()
        super().close()

    def wait_any(self, handles: Sequence[Future], timeout: float | None = None) -> list[Future]:
        waiting = [h for h in handles if h in self.held and not self.held[h][1].is_set()]
        if waiting and len(waiting) == len(handles):  # nothing else runs: release the first
            self.held[min(waiting, key=lambda h: self.held[h][0].mb)][1].set()
        return super().wait_any(handles, timeout)


def _cfg(shape: str, estimator: str, async_pipeline: bool, tmp_path: Path):
    over = [*SMALL, f"run_dir={tmp_path / 'run'}", f"codesign.async_pipeline={str(async_pipeline).lower()}",
            *(f"team.agents.{a}.algorithm.advantage={estimator}" for a in AGENTS)]
    return load_config(str(CONFIGS[shape]), over)


CASES = [(shape, est, on) for shape in ("graph", "program") for est in ADVANTAGES.names()
         for on in (True, False)]


@pytest.mark.parametrize(("shape", "estimator", "async_pipeline"), CASES,
                         ids=[f"{s}-{e}-{'async' if a else 'sync'}" for s, e, a in CASES])
def test_train_ops_wait_for_what_their_estimator_reads(shape, estimator, async_pipeline, tmp_path):
    if shape == "program" and advantage_scope(estimator) == "critic":
        # not runnable: the config says so rather than the run failing
        with pytest.raises(ConfigError, match="gae needs the call order"):
            _cfg(shape, estimator, async_pipeline, tmp_path)
        return
    cfg = _cfg(shape, estimator, async_pipeline, tmp_path)
    plan = Plan.build(cfg)
    rewarding = [op for op in plan.deps if op.kind in ("reward", "program")]
    if advantage_scope(estimator) == "batch" or not async_pipeline:  # every train op: every reward
        for a in AGENTS:
            for j in range(plan.num_mb):
                assert set(rewarding) <= set(plan.deps[Op(0, "train", a, mb=j)]), (a, j)
    run_dir = run.prepare_run(cfg)
    ex = RewardsLast(run_dir)
    try:
        out = run.train(cfg, run_dir, ex, plan=plan)
    finally:
        ex.close()
    assert out.ops == len(plan.deps)
    # The held rewarding op ran after every train op the plan allowed before it: some with a
    # group-scoped estimator on the async pipeline (so the hold really reorders), none else.
    last = max(i for i, op in enumerate(ex.started) if op in rewarding)
    early = [op.name for op in ex.started[:last] if op.kind == "train"]
    assert bool(early) == (async_pipeline and advantage_scope(estimator) != "batch"), early
    store = MEGStore(cfg.resolved_store_uri())
    for a in AGENTS:  # every sample of the iteration trained, with an advantage
        tbl = store.read_samples(a, 0, columns=["sample_id", "advantage", "consumed_step"])
        assert tbl.num_rows > 0 and tbl.column("consumed_step").null_count == 0, a
        assert tbl.column("advantage").null_count == 0, a
