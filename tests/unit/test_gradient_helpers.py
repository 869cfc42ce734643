"""Gradient helpers (`codesign.gradient_helpers`): a train op whose agent's slot is busy runs
on an idle slot, computes the micro-batch's gradient on a copy of the weights, and the agent's
step adds it. The control plane's decision, the orchestrator's rule that an agent's trainer
runs one op at a time, and the real stages: the weights equal those of a run without helpers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmarl_core.config import load_config
from flexmarl_core.control import GradientHelper
from flexmarl_core.driver.run import completed_records
from flexmarl_core.ops import Op, StageResult
from flexmarl_core.runfiles.location import gradient_key
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
from tests.unit.test_orchestrator import cfg_of
from tests.unit.test_orchestrator import run as run_on_threads

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def _run(cfg, holds=None):
    """The orchestrator on threads: (result, log of (op, worker, ran as a helper, start, end))."""
    helpers: list[Op] = []
    res, log = run_on_threads(cfg, delay=lambda op: 0.05 if op.kind == "train" else 0.005, helpers=helpers,
                              holds=holds)
    return res, [(o, w, o in helpers, t0, t1) for o, w, t0, t1 in log]


def _solver_helped(it: int):
    return lambda seen: any(o.agent == "solver" and o.iteration == it for o in seen.helpers)


@pytest.mark.parametrize("helpers", [False, True])
def test_busy_slot_lends_train_ops_to_an_idle_one(helpers):
    """With helpers, the solver's train ops are held until a solver helper of their iteration
    has started: the trainer's slot is busy with the first one meanwhile, so the others can
    only go on as helpers (an agent's trainer runs one op at a time).

    Only the solver trains: a helper needs a slot with nothing outstanding when the op is
    routed, and the other agents' train ops of the same micro-batch, routed in any order
    beside the solver's, could hold the other slot at every such moment (the last
    micro-batch's train op is routed after the iteration's rollouts, onto an idle slot)."""
    cfg = cfg_of({"gradient_helpers": helpers}, iterations=2, mbs=4)
    for agent in ("planner", "verifier"):
        cfg.agent(agent).trainable = False
    holds = {Op(it, "train", "solver", mb=mb): _solver_helped(it) for it in range(2) for mb in range(4)}
    res, log = _run(cfg, holds if helpers else None)
    helped = [(o, w) for o, w, g, *_ in log if g]
    decisions = [d for d in res.decisions if isinstance(d, GradientHelper)]
    if not helpers:
        assert not helped and not decisions
        return
    assert sorted(res.released) == sorted(holds), "a solver train op waited for a helper that never came"
    assert {o.iteration for o, _ in helped if o.agent == "solver"} == {0, 1}
    assert all(o.kind == "train" for o, _ in helped)
    assert len(decisions) == len(helped)
    for agent in ("solver",):
        for it in range(2):
            own = [(o, w, t0, t1) for o, w, g, t0, t1 in log
                   if o.agent == agent and o.iteration == it and o.kind in ("train", "step", "sync") and not g]
            # The trainer's own ops: one worker, one at a time.
            assert len({w for _, w, *_ in own}) == 1, (agent, it)
            spans = sorted((t0, t1) for *_, t0, t1 in own)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), (agent, it)
            home = own[0][1]
            for d in decisions:
                if d.agent == agent and d.iteration == it:
                    assert d.slot == home and d.worker != home and d.queued >= 1
            # The step waits for every train op of the iteration, helpers' included.
            step0 = next(t0 for o, _, _, t0, _ in log if o == Op(it, "step", agent))
            trains = [t1 for o, _, _, _, t1 in log if o.kind == "train" and o.agent == agent and o.iteration == it]
            assert len(trains) == 4 and max(trains) <= step0


def test_helper_agents_are_the_trainable_torch_agents():
    """(Without on-demand allocation or with staleness the config refuses helpers:
    tests/unit/test_switches.py.)"""
    from flexmarl_core.control import helper_agents

    agents = ["planner", "solver", "verifier"]
    on, off = cfg_of({"gradient_helpers": True}), cfg_of({})
    assert helper_agents(on.codesign.gradient_helpers, on.team.agents) == frozenset(agents)
    assert helper_agents(off.codesign.gradient_helpers, off.team.agents) == frozenset()
    frozen = load_config(TINY, ["codesign.gradient_helpers=true", "team.agents.planner.trainable=false"])
    assert helper_agents(frozen.codesign.gradient_helpers, frozen.team.agents) == frozenset({"solver", "verifier"})


def _real_run(tmp_path: Path, name: str, helpers: bool, lose_gradients: bool = False):
    """Two iterations of the tiny team through the real stages on two in-process workers. With
    helpers, the solver's first train op of an iteration waits (outside the stage, holding its
    worker) until a solver helper op has started, so a helper takes the other micro-batch while
    the trainer's slot is busy. `lose_gradients`: each helper's gradient file is deleted as its
    op ends, as if the helper's storage lost it."""
    from flexmarl_core.driver import run

    cfg = load_config(TINY, [f"run_dir={tmp_path}/{name}", "train.iterations=2", "train.evaluate=false",
                             "batch.inputs_per_iteration=4", "batch.micro_batch_inputs=2",
                             "workload.reward=tests.reward_fns:varied", "workload.credit=team",
                             f"codesign.gradient_helpers={str(helpers).lower()}"])
    run_dir = run.prepare_run(cfg)
    real = stage_fn(str(run_dir))
    started = {it: threading.Event() for it in range(2)}
    helped: list[Op] = []
    first: set[int] = set()

    def fn(op: Op, worker: str, gradient_only: bool = False) -> StageResult:
        if gradient_only:
            helped.append(op)
            if op.agent == "solver":
                started[op.iteration].set()
        elif helpers and op.kind == "train" and op.agent == "solver" and op.iteration not in first:
            first.add(op.iteration)
            started[op.iteration].wait(timeout=30)
        res = real(op, worker, gradient_only=gradient_only)
        if gradient_only and lose_gradients:
            (Path(run_dir) / gradient_key(op.agent, op.iteration, op.mb)).unlink()
        return res

    ex = ThreadExecutor(fn, {"w0": {"rollout": 1, "train": 1}, "w1": {"rollout": 1, "train": 1}})
    try:
        out = run.train(cfg, run_dir, ex)
    finally:
        ex.close()
    return cfg, Path(run_dir), out, helped


def _same_weights(a_dir: Path, b_dir: Path) -> None:
    for agent in ("planner", "solver", "verifier"):
        a = load_file(str(a_dir / "weights" / agent / "v2.safetensors"))
        b = load_file(str(b_dir / "weights" / agent / "v2.safetensors"))
        w0 = load_file(str(a_dir / "weights" / agent / "v0.safetensors"))
        assert any(not torch.equal(a[k], w0[k]) for k in a), f"{agent} did not train"
        # The same gradients summed in another order: fp32 rounding of weights ~1 after two
        # Adam steps of lr 1e-4, far below the step itself.
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=f"{agent}.{k}")


def test_helper_gradients_train_the_same_weights(tmp_path):
    _, plain_dir, _, none = _real_run(tmp_path, "plain", helpers=False)
    _, help_dir, _, helped = _real_run(tmp_path, "helped", helpers=True)
    assert not none
    assert {o.iteration for o in helped if o.agent == "solver"} == {0, 1}, helped
    steps = [r for r in completed_records(help_dir) if r.op.kind == "step"]  # the op log's
    assert sum(r.result.metrics[f"agent/{r.op.agent}/helper_mbs"] for r in steps) == len(helped)
    # Every helper's gradient was added by its step and then removed.
    assert not list((help_dir / "gradients").rglob("*.safetensors"))
    _same_weights(plain_dir, help_dir)
    # A helper whose gradient file is lost: the step recomputes that micro-batch from the store.
    _, lost_dir, _, helped = _real_run(tmp_path, "lost", helpers=True, lose_gradients=True)
    steps = [r for r in completed_records(lost_dir) if r.op.kind == "step"]
    assert helped and sum(r.result.metrics[f"agent/{r.op.agent}/helper_mbs"] for r in steps) == 0
    assert sum(r.result.metrics[f"agent/{r.op.agent}/recomputed_mbs"] for r in steps) == len(helped)
    _same_weights(plain_dir, lost_dir)
