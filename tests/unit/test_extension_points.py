"""A new op kind and a new estimator scope each go in one place: the kind's traits (`ops.py`)
and its stage, the scope's class (`trainers/scopes.py`). The plan, the router, the orchestrator,
the metrics and the real train stage take them with no other change; a kind without traits is
refused by the router, never placed as a guess.

The throwaway kind `tally` runs after each micro-batch's reward (a team shape built on the
graph team's adds it); the throwaway scope `after_first` makes every train op wait for the
first micro-batch's too, and reads the rows as the group scope does, counting its reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl_core.algorithms import ADVANTAGES, get_advantage
from flexmarl_core.algorithms.advantages import register_advantage
from flexmarl_core.config import load_config
from flexmarl_core.control.router import OrchestratorError, Router
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.ops import KINDS, KindTraits, Op, StageResult, register_kind
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.stages.registry import STAGES, stage
from flexmarl_core.teams.api import SHAPES, Generation, PlanView, register_shape
from flexmarl_core.teams.graph import GraphTeam
from flexmarl_core.trainers.scopes import SCOPES, GroupScope, ScopePlan, register_scope
from tests._runs import train_on_threads

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
AGENTS = ("planner", "solver", "verifier")
READS: list[tuple[str, int, int]] = []


@pytest.fixture
def throwaway():
    """Registers the kind, its stage, the shape, the scope and an estimator of that scope;
    takes them all out again afterwards (the registries are the process's)."""
    register_kind("tally", KindTraits("anywhere", retries=0))

    @stage("tally")
    def tally(ctx, op: Op) -> StageResult:
        ctx.loc.write_text(f"tally/{op.iteration}-{op.mb}.json", json.dumps({"inputs": len(ctx.inputs(op.iteration, op.mb))}))
        return StageResult(op, samples=1)

    @register_shape("graph_tally")
    class TallyTeam(GraphTeam):
        def generation(self, plan: PlanView, it: int) -> Generation:
            gen = super().generation(plan, it)
            tallies = [Op(it, "tally", mb=j) for j in range(plan.num_mb)]
            deps = {**gen.deps, **{t: list(r) for t, r in zip(tallies, gen.rewarded, strict=True)}}
            return Generation(deps, [[t] for t in tallies])

    @register_scope("after_first")
    class AfterFirst(GroupScope):
        def waits(self, plan: ScopePlan, it: int, mb: int, mine: list[Op], every: list[Op]) -> list[Op]:
            return list(dict.fromkeys([*mine, every[0]]))

        def read(self, ctx, agent, estimator, it, mb):
            READS.append((agent, it, mb))
            return super().read(ctx, agent, estimator, it, mb)

    register_advantage("grpo_after_first", scope="after_first")(get_advantage("grpo"))
    READS.clear()
    try:
        yield
    finally:
        KINDS.pop("tally")
        STAGES.pop("tally")
        for reg, name in ((SHAPES, "graph_tally"), (SCOPES, "after_first"), (ADVANTAGES, "grpo_after_first")):
            reg._items.pop(name)
            reg._meta.pop(name)


def _cfg(run_dir: Path):
    return load_config(TINY, [f"run_dir={run_dir}", "team.shape=graph_tally", "train.evaluate=false",
                              "train.evaluate_initial=false", "train.warm_start=none", "workload.heldout_size=8",
                              *(f"team.agents.{a}.algorithm.advantage=grpo_after_first" for a in AGENTS)])


def test_a_new_op_kind_and_scope_go_through_the_plan_and_a_real_run(throwaway, tmp_path):
    cfg = _cfg(tmp_path / "run")
    plan = Plan.build(cfg)
    for it in range(cfg.train.iterations):
        for j in range(plan.num_mb):
            assert plan.deps[Op(it, "tally", mb=j)] == [Op(it, "reward", mb=j)]
            for a in AGENTS:  # the scope's rule: its own micro-batch's tally and the first one's
                assert {Op(it, "tally", mb=j), Op(it, "tally", mb=0)} <= set(plan.deps[Op(it, "train", a, mb=j)])
    folder, out = train_on_threads(cfg)
    assert [m["iteration"] for m in out.iterations] == list(range(cfg.train.iterations))
    assert audit_run(str(folder))[1] == []
    every = {(it, j) for it in range(cfg.train.iterations) for j in range(plan.num_mb)}
    assert {tuple(int(x) for x in p.stem.split("-")) for p in (Path(folder) / "tally").glob("*.json")} == every
    # the real train stage read each agent's micro-batches through the new scope
    assert {(a, it, j) for a, it, j in READS} == {(a, it, j) for a in AGENTS for it, j in every}
    ops = [json.loads(x) for x in (Path(folder) / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    assert sum(1 for o in ops if o["kind"] == "tally") == len(every)


def test_the_router_refuses_a_kind_without_traits():
    router = Router(load_balancing=True, rollout_slots=lambda w: 1, on_demand=False, num_mb=1,
                    helper_agents=frozenset(), clock=lambda: 0.0)
    with pytest.raises(OrchestratorError, match=r"judge it=0: unknown op kind 'judge'; kinds: \['rollout'"):
        router.route(Op(0, "judge"), {"w0": {"rollout": 1, "train": 1}})
