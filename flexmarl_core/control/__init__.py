"""The control plane: every decision about where work runs, and the record of each one.

    ControlPlane.place(ready, running, workers)   before a submission wave: move instances
    ControlPlane.route(op, workers) -> Route      rollout instance, training slot, or anywhere
                                                  (None: hold it, `codesign.late_binding`)
    ControlPlane.route_ahead(op, workers)         the route, if no later decision could change it
    ControlPlane.submitted / finished / observed  keep the work ledger in seconds
    ControlPlane.decisions                        MoveInstance, TrainSlot, GradientHelper, Resubmit, HungOp,
                                                  StoreRetries

Pure Python, no Dask: the orchestrator applies re-tags through its executor, so the same
policies run against a real cluster, threads, or a simulated clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from flexmarl_core.config import AgentConfig, ExperimentConfig
from flexmarl_core.control.balancer import InstanceBalancer, apply_move, lend_idle, rebalance
from flexmarl_core.control.decisions import (
    Decision,
    GradientHelper,
    HungOp,
    MoveInstance,
    Resubmit,
    StoreRetries,
    TrainSlot,
)
from flexmarl_core.control.ledger import WorkLedger, token_sizes
from flexmarl_core.control.router import OrchestratorError, Router
from flexmarl_core.control.tags import ROLLOUT_TAG, TRAIN_TAG, rollout_tag
from flexmarl_core.ops import KINDS, Op, Route, StageResult, traits
from flexmarl_core.runfiles.location import base_weights_key, weights_key

__all__ = [
    "ROLLOUT_TAG", "TRAIN_TAG", "ControlPlane", "Decision", "GradientHelper", "InstanceBalancer",
    "HungOp", "MoveInstance", "OrchestratorError", "Resubmit", "Router", "StoreRetries", "TrainSlot", "WorkLedger",
    "apply_move", "lend_idle", "rebalance", "rollout_tag", "token_sizes",
]


def _move_costs(cfg: ExperimentConfig, agents: list[str]) -> dict[str, dict]:
    """What an instance move of a LoRA agent loads, from the run folder's published files
    (absent: 0 bytes): its adapter, and its base where the worker has none. Full-model teams
    keep the balancer as it was (no costs; torch is not imported here for them)."""
    lora = [a for a in agents if cfg.agent(a).model.lora is not None]
    if not lora:
        return {}
    from flexmarl_core.models.lora import base_key  # torch: only for LoRA teams

    loc = cfg.run_location()
    base_of = {a: base_key(cfg.agent(a).model, cfg.seed) for a in lora}
    size = lambda key: loc.size(key) if loc.exists(key) else 0  # noqa: E731
    return {"base_of": base_of,
            "weight_bytes": {a: size(weights_key(a, 0)) for a in agents},
            "base_bytes": {k: size(base_weights_key(k)) for k in set(base_of.values())}}


def helper_agents(gradient_helpers: bool, agents: Sequence[AgentConfig]) -> frozenset[str]:
    """The agents whose train ops may run as gradient helpers (`codesign.gradient_helpers`; the
    config refuses it without `on_demand_allocation` or with staleness): trainable, one torch
    process holding the whole model (a helper adds a gradient of the flat buffer; DeepSpeed
    shards it, LoRA trains an adapter)."""
    if not gradient_helpers:
        return frozenset()
    return frozenset(a.name for a in agents if a.trainable and a.model.lora is None and a.backend.training == "torch")


class ControlPlane:
    def __init__(self, cfg: ExperimentConfig, agents: list[str], clock: Callable[[], float],
                 sizes: dict[str, dict[str, float]] | None = None,
                 rollout_slots: Callable[[str], int] | None = None) -> None:
        """`sizes`: kind -> agent -> an op's expected work, for the warm estimates
        (`ledger.token_sizes`, or the simulator's cost model). `rollout_slots`: rollouts a worker
        may hold at once under late binding (default 1; `Router`)."""
        self.clock = clock
        self.deadlines = cfg.cluster.deadlines
        self.decisions: list[Decision] = []
        cs = cfg.codesign
        self.late_binding = cs.late_binding  # the config refuses it without load_balancing
        self.router = Router(load_balancing=cs.load_balancing, on_demand=cs.on_demand_allocation,
                             late_binding=self.late_binding, num_mb=cfg.batch.num_micro_batches, clock=clock,
                             log=self.decisions, helper_agents=helper_agents(cfg.codesign.gradient_helpers, [cfg.agent(a) for a in agents]),
                             rollout_slots=rollout_slots)
        self.ledger = self.router.ledger
        self.ledger.sizes = dict(sizes or {})
        self.balancer = (
            InstanceBalancer(agents=agents, threshold=cs.balance_threshold, est_s=self.ledger.est_s["rollout"],
                             prior=lambda a: self.ledger.estimate("rollout", a),
                             **_move_costs(cfg, agents))
            if cs.load_balancing else None
        )

    def place(
        self,
        ready: list[Op],
        running: Iterable[tuple[Op, Route]],
        workers: dict[str, dict[str, float]],
        retag: Callable[[str, dict[str, float]], None],
    ) -> dict[str, dict[str, float]]:
        """Inter-agent balancing before a submission wave; the workers' tags afterwards."""
        if self.balancer is None or not any(traits(op.kind).generates for op in ready):
            return workers
        workers, moves = rebalance(self.balancer, ready, running, workers, self.ledger.work, retag,
                                   self.clock())
        if self.late_binding:
            workers, lent = lend_idle(ready, workers, self.ledger.outstanding, retag, self.clock())
            moves += lent
        self.decisions.extend(moves)
        return workers

    def route(self, op: Op, workers: dict[str, dict[str, float]]) -> Route | None:
        return self.router.route(op, workers)

    def route_ahead(self, op: Op, workers: dict[str, dict[str, float]]) -> Route | None:
        """`op`'s route if it can be fixed now, before its dependencies end (the orchestrator's
        look-ahead), because nothing the control plane would decide later could change it:
        by its kind's placement: `anywhere` (rewards) goes anywhere; rollouts without load balancing go by tag (Dask places them),
        with it only to an agent's one instance when no instance can move (one agent); trainer
        ops to a slot already chosen for the agent's iteration (static placement, an on-demand
        slot taken, or one train slot); never a helper agent's train op (whether a helper takes
        it depends on the slots' load when it is ready), nor a host op (a program op: how many run at
        once depends on the ops running when it is ready), nor a kind without traits (`route`
        says so when it is ready). None: route it when it is ready."""
        placement = KINDS[op.kind].placement if op.kind in KINDS else None
        if placement == "anywhere":
            return Route({})
        if placement in ("host", None) or self.router.may_help(op):
            return None
        if placement == "instance" and self.router.load_balancing:
            if self.balancer is not None and len(self.balancer.agents) > 1:
                return None
            if len(self.router.instances(op.agent, workers)[1]) != 1:
                return None
        elif placement == "trainer":
            slots = self.router.slots
            if slots.on_demand and (op.agent, op.iteration) not in slots.slot and \
                    sum(1 for r in workers.values() if r.get(TRAIN_TAG, 0) > 0) != 1:
                return None
        try:
            return self.router.route(op, workers)
        except OrchestratorError:  # no worker can take it: say so when it is ready
            return None

    def submitted(self, op: Op, route: Route) -> None:
        self.ledger.submitted(op, route.worker)
        if self.balancer is not None and traits(op.kind).placement == "instance" and route.worker:
            self.balancer.fresh.discard((route.worker, op.agent))

    def finished(self, op: Op, route: Route) -> None:
        self.ledger.finished(op, route.worker)

    def observed(self, res: StageResult) -> None:
        """A finished op's measurement: it feeds the duration estimates and is never charged
        again. Swap-in time is the move's cost, not the op's: kept out of the estimate."""
        self.ledger.completed.add(res.op)
        if res.metrics.get("store/retries"):
            self.decisions.append(StoreRetries(t=self.clock(), op=res.op.name, worker=res.worker,
                                               retries=int(res.metrics["store/retries"])))
        self._learn(res)

    def _learn(self, res: StageResult) -> None:
        if res.t_end:
            self.ledger.observe(res.op, res.seconds - res.swap.get("swap_in_s", 0.0))
        if traits(res.op.kind).placement == "host" and self.balancer is not None:
            for agent, secs in res.per_agent("program/decode_s").items():
                self.ledger.record("rollout", agent, secs)  # the balancer's table

    def forget(self, below: int) -> None:
        """The ops of iterations before `below` are done and none to come is routed against
        them: drop what the ledger keeps of them."""
        self.ledger.completed = {op for op in self.ledger.completed if op.iteration >= below}

    def warm(self, earlier: Iterable[StageResult]) -> None:
        """Start the estimates from an earlier attempt's finished ops (a resumed run)."""
        for res in sorted(earlier, key=lambda r: r.t_end):
            self._learn(res)

    def deadline(self, op: Op, route: Route) -> float:
        """Seconds after which `op`, submitted now on `route`, counts as hung
        (`cluster.deadlines`): a fixed one for its kind, else `factor` times its estimate and
        the ops queued ahead of it on its worker, never under `floor_s`."""
        d = self.deadlines
        if op.kind in d.per_kind_s and op.kind != "reward":  # `reward` bounds each reward call instead
            return d.per_kind_s[op.kind]
        ahead = self.ledger.outstanding.get(route.worker, 0) if route.worker else 0
        return max(d.floor_s, d.factor * self.ledger.estimate(op.kind, op.agent) * (1 + ahead))

    def hung(self, ops: str, worker: str, deadline_s: float, waited_s: float) -> None:
        """`ops` (one op's name, or a fused run's names joined by ` + `) ran past its deadline."""
        self.decisions.append(HungOp(t=self.clock(), op=ops, worker=worker,
                                     deadline_s=round(deadline_s, 3), waited_s=round(waited_s, 3)))

    def resubmitted(self, op: Op, route: Route, exc: BaseException) -> None:
        self.decisions.append(Resubmit(t=self.clock(), op=op.name, worker=route.worker,
                                       error=f"{type(exc).__name__}: {exc}"[:300]))
