"""Joint Orchestrator: the iteration task graph and the event loop that runs it.

The graph mirrors the MEG. Per iteration `it` and micro-batch `mb` (whole GRPO groups):

    rollout(agent@turn, it, mb) ─► ... ─► reward(it, mb) ─► train(agent, it, mb) ─► step(agent, it) ─► sync(agent, it)
                 ▲                                                                                       │
                 └──────────────────────── rollout(agent@*, it+1, *) waits for it ◄──────────────────────┘

The co-design switches only change dependencies and routing, never the work itself:

- `dependency_parallel`: a rollout waits for its parents' *same micro-batch*; off: for the parents'
  whole batch (and rewards wait for every rollout of the iteration).
- `async_pipeline`: training of a micro-batch waits only for its rewards and an agent's next
  iteration only for its own weight sync (plus its parents); off: training waits for the whole
  rollout phase and iteration it+1 waits for every agent's sync of it (the synchronous baseline).
- `load_balancing` and `on_demand_allocation` are routing decisions made by the `Router` at the
  moment a node is submitted (a task already waiting on a Dask tag would not move).

The loop talks to an `Executor` (submit with routing, wait for any) so this module never
imports Prefect or Dask; `tasks/` provides the Prefect-on-Dask executor.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from flexmarl_core.balancer import InstanceBalancer, apply_move
from flexmarl_core.config import ExperimentConfig
from flexmarl_core.meg import MEG

OpKind = Literal["rollout", "reward", "train", "step", "sync"]
STAGES: tuple[OpKind, ...] = ("rollout", "reward", "train", "step", "sync")

#: Dask resource tags. A worker tagged `rollout:<agent>` hosts an inference instance dedicated to
#: that agent; a plain `rollout` tag serves any agent. `train` marks a training slot.
ROLLOUT_TAG = "rollout"
TRAIN_TAG = "train"


def rollout_tag(agent: str) -> str:
    return f"{ROLLOUT_TAG}:{agent}"


@dataclass(frozen=True, slots=True, order=True)
class Op:
    """One node of the iteration task graph."""

    iteration: int
    kind: OpKind
    agent: str = ""
    turn: int = 0
    mb: int = -1

    @property
    def name(self) -> str:
        who = f"[{self.agent}]" if self.agent else ""
        turn = f"@{self.turn}" if self.kind == "rollout" and self.turn else ""
        mb = f" mb={self.mb}" if self.mb >= 0 else ""
        return f"{self.kind}{who}{turn} it={self.iteration}{mb}"


class OrchestratorError(RuntimeError):
    """The run cannot go on; the message names the op and the reason."""


@dataclass(frozen=True, slots=True)
class Route:
    """Where an op runs: Dask resources it needs and, optionally, one worker it is pinned to."""

    resources: dict[str, float]
    worker: str | None = None


class Executor(Protocol):
    """What the orchestrator needs from a cluster. Implementations: `ThreadExecutor` here,
    `tasks.executor.PrefectDaskExecutor` for the real run."""

    def submit(self, op: Op, kwargs: dict[str, Any], route: Route) -> Any: ...

    def wait_any(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]: ...

    def result(self, handle: Any) -> dict[str, Any]: ...

    def worker_resources(self) -> dict[str, dict[str, float]]:
        """Current resource tags of every worker, by worker address."""
        ...

    def set_worker_resources(self, worker: str, resources: dict[str, float]) -> None: ...

    def lost(self, exc: BaseException) -> bool:
        """True when `exc` means the op's worker died or vanished (not that the op failed):
        the orchestrator then routes and submits the op again."""
        ...


#: How often one op is resubmitted after losing its worker before the run gives up.
LOST_WORKER_RESUBMITS = 3


# -- the graph --------------------------------------------------------------------------------


@dataclass
class Plan:
    """All ops of a run and their dependencies, derived from the MEG and the switches."""

    meg: MEG
    iterations: int
    num_mb: int
    dependency_parallel: bool
    async_pipeline: bool
    first_iteration: int = 0
    deps: dict[Op, list[Op]] = field(default_factory=dict)

    @classmethod
    def build(cls, cfg: ExperimentConfig, meg: MEG, first_iteration: int = 0) -> Plan:
        plan = cls(
            meg=meg,
            iterations=cfg.train.iterations,
            num_mb=cfg.batch.num_micro_batches,
            dependency_parallel=cfg.codesign.dependency_parallel,
            async_pipeline=cfg.codesign.async_pipeline,
            first_iteration=first_iteration,
        )
        for it in range(first_iteration, cfg.train.iterations):
            plan._add_iteration(it)
        return plan

    def _add_iteration(self, it: int) -> None:
        meg, mbs = self.meg, range(self.num_mb)
        trainable = meg.trainable_agents
        rollouts = {(n.agent, n.turn, j): Op(it, "rollout", n.agent, n.turn, j) for n in meg.nodes for j in mbs}
        prev_syncs = [Op(it - 1, "sync", a) for a in trainable] if it > self.first_iteration else []
        for n in meg.nodes:
            for j in mbs:
                d: list[Op] = []
                for p in meg.parents[n]:
                    if self.dependency_parallel:
                        d.append(rollouts[(p.agent, p.turn, j)])
                    else:
                        d.extend(rollouts[(p.agent, p.turn, k)] for k in mbs)
                if self.async_pipeline:
                    # Only this agent's own new weights gate its next iteration.
                    d.extend(s for s in prev_syncs if s.agent == n.agent)
                else:
                    d.extend(prev_syncs)
                self.deps[rollouts[(n.agent, n.turn, j)]] = d
        all_rollouts = list(rollouts.values())
        for j in mbs:
            if self.dependency_parallel:
                d = [op for (_, _, k), op in rollouts.items() if k == j]
            else:
                d = list(all_rollouts)
            self.deps[Op(it, "reward", mb=j)] = d
        rewards = [Op(it, "reward", mb=j) for j in mbs]
        for a in trainable:
            for j in mbs:
                self.deps[Op(it, "train", a, mb=j)] = (
                    [Op(it, "reward", mb=j)] if self.async_pipeline else list(rewards)
                )
            self.deps[Op(it, "step", a)] = [Op(it, "train", a, mb=j) for j in mbs]
            self.deps[Op(it, "sync", a)] = [Op(it, "step", a)]

    def ops(self) -> list[Op]:
        return list(self.deps)

    def count(self, kind: OpKind) -> int:
        return sum(1 for op in self.deps if op.kind == kind)


# -- routing ----------------------------------------------------------------------------------

#: op seconds assumed before an op kind was measured (a train micro-batch ~ 2 rollouts on CPU)
DEFAULT_OP_S: dict[str, float] = {"rollout": 1.0, "reward": 0.05, "train": 2.0, "step": 0.05, "sync": 0.05}


@dataclass
class Router:
    """Chooses where each op runs, at the moment it is submitted.

    Rollouts go to an instance of their agent: a worker tagged `rollout:<agent>`, else any worker
    tagged `rollout`. With `load_balancing`, the least-loaded instance is chosen (intra-agent
    balancing; the `InstanceBalancer` moves instances between agents); without it, Dask places
    the task among the tagged workers.

    An agent's trainer accumulates gradients in one worker's memory, so its train/step/sync ops
    of one iteration run on one worker. Without `on_demand` that worker is fixed for the run
    (agents spread over the `train` slots in agent order). With `on_demand`, each agent's
    iteration takes the least-loaded slot when its first micro-batch is ready, and the worker
    swaps the trainer state in from its last checkpoint if it does not hold it.

    Load is seconds of work, not task counts: each op is charged its kind's and agent's recent
    duration (`observe`) to the worker it goes to, and an on-demand allocation charges the
    slot the agent's whole iteration of training at once. Counting tasks put a solver's
    2.8 s micro-batches level with a planner's 1.6 s ones, and the iteration's training
    piled onto one worker while the other idled (measured: 4.6 s per iteration).
    """

    load_balancing: bool
    on_demand: bool = False
    #: micro-batches per iteration (an allocation reserves that many train ops)
    num_mb: int = 1
    outstanding: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: estimated seconds of work routed to each worker and not finished (plus reservations)
    work: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: kind -> agent -> moving average of measured op seconds (the rollout table is also the
    #: InstanceBalancer's, so both read one estimate)
    est_s: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    #: op -> (worker, seconds) charged to that worker until the op finishes
    charges: dict[Op, tuple[str, float]] = field(default_factory=dict)
    trainer_home: dict[str, str] = field(default_factory=dict)
    #: on-demand: the slot of each (agent, iteration) and where each agent's state was last
    slot: dict[tuple[str, int], str] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    #: ops already done (in this run, or an earlier attempt when resuming): never charged again
    completed: set[Op] = field(default_factory=set)
    #: an on-demand slot that already holds the state wins unless another has this much less work
    SWAP_PENALTY_S: ClassVar[float] = 0.2

    def estimate(self, kind: str, agent: str) -> float:
        per_agent = self.est_s.get(kind, {})
        if agent in per_agent:
            return per_agent[agent]
        return sum(per_agent.values()) / len(per_agent) if per_agent else DEFAULT_OP_S[kind]

    def observe(self, op: Op, seconds: float, alpha: float = 0.5) -> None:
        per_agent = self.est_s[op.kind]
        prev = per_agent.get(op.agent)
        per_agent[op.agent] = seconds if prev is None else (1 - alpha) * prev + alpha * seconds

    def submitted(self, op: Op, worker: str | None) -> None:
        if worker is None:
            return
        self.outstanding[worker] += 1
        if op not in self.charges:  # trainer ops of an allocation were charged up front
            self._charge(op, worker, self.estimate(op.kind, op.agent))

    def finished(self, op: Op, worker: str | None) -> None:
        if worker is not None:
            self.outstanding[worker] -= 1
        w, secs = self.charges.pop(op, (None, 0.0))
        if w is not None:
            self.work[w] = max(self.work[w] - secs, 0.0)

    def _charge(self, op: Op, worker: str, secs: float) -> None:
        self.charges[op] = (worker, secs)
        self.work[worker] += secs

    def instances(self, agent: str, workers: dict[str, dict[str, float]]) -> tuple[str, list[str]]:
        dedicated = [w for w, r in workers.items() if r.get(rollout_tag(agent), 0) > 0]
        if dedicated:
            return rollout_tag(agent), sorted(dedicated)
        shared = [w for w, r in workers.items() if r.get(ROLLOUT_TAG, 0) > 0]
        return ROLLOUT_TAG, sorted(shared)

    def route(self, op: Op, workers: dict[str, dict[str, float]]) -> Route:
        if op.kind == "rollout":
            tag, candidates = self.instances(op.agent, workers)
            if not candidates:
                raise OrchestratorError(
                    f"{op.name}: no worker has resource tag {rollout_tag(op.agent)!r} or "
                    f"{ROLLOUT_TAG!r}; workers: {workers}. Add the tag to a worker in cluster.workers."
                )
            if not self.load_balancing:
                return Route({tag: 1})
            worker = min(candidates, key=lambda w: (self.work[w], self.outstanding[w], w))
            return Route({tag: 1}, worker)
        if op.kind in ("train", "step", "sync"):
            slots = sorted(w for w, r in workers.items() if r.get(TRAIN_TAG, 0) > 0)
            if not slots:
                raise OrchestratorError(f"{op.name}: no worker has resource tag {TRAIN_TAG!r}; workers: {workers}")
            return Route({TRAIN_TAG: 1}, self._train_slot(op, slots))
        return Route({})  # reward: cheap, anywhere

    def _train_slot(self, op: Op, slots: list[str]) -> str:
        if not self.on_demand:
            home = self.trainer_home.get(op.agent)
            if home is None or home not in slots:
                # Spread trainers over the training slots in agent order (static placement).
                taken: dict[str, int] = defaultdict(int)
                for w in self.trainer_home.values():
                    taken[w] += 1
                home = min(slots, key=lambda w: (taken[w], w))
                self.trainer_home[op.agent] = home
            return home
        key = (op.agent, op.iteration)
        slot = self.slot.get(key)
        if slot is None or slot not in slots:
            last = self.trainer_home.get(op.agent)
            # Least work; the slot already holding the state unless another is clearly freer.
            slot = min(slots, key=lambda w: (self.work[w] - (self.SWAP_PENALTY_S if w == last else 0.0), w))
            self.slot[key] = slot
            self.decisions.append({
                "t": time.time(), "decision": "train_slot", "agent": op.agent,
                "iteration": op.iteration, "worker": slot, "state_was_on": last,
                "swap": last is not None and last != slot,
                "loads": {w: self.outstanding[w] for w in slots},
                "work_s": {w: round(self.work[w], 3) for w in slots},
            })
            self.trainer_home[op.agent] = slot
            # The whole iteration's training goes there: charge it now, so the next
            # allocation sees it even before those ops are ready to submit. A re-allocation
            # (the slot's worker is gone) moves what is still charged to the old slot.
            ops = [Op(op.iteration, "train", op.agent, mb=j) for j in range(self.num_mb)]
            ops += [Op(op.iteration, "step", op.agent), Op(op.iteration, "sync", op.agent)]
            for t in ops:
                if t in self.completed:
                    continue
                old = self.charges.pop(t, None)
                if old is not None:
                    self.work[old[0]] = max(self.work[old[0]] - old[1], 0.0)
                self._charge(t, slot, old[1] if old else self.estimate(t.kind, op.agent))
        return slot


# -- the loop ---------------------------------------------------------------------------------


@dataclass
class OpRecord:
    op: Op
    submitted: float
    finished: float
    worker: str | None
    result: dict[str, Any]


@dataclass
class RunResult:
    records: list[OpRecord]
    wall_s: float
    started: float
    #: control-plane decisions: instance moves and training-slot allocations, in order
    decisions: list[dict[str, Any]] = field(default_factory=list)


class Orchestrator:
    """Submits each op when its dependencies are done, with the route chosen at that moment."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        meg: MEG,
        executor: Executor,
        op_kwargs: Callable[[Op], dict[str, Any]],
        *,
        first_iteration: int = 0,
        on_op_done: Callable[[OpRecord], None] | None = None,
        skip: Iterable[Op] = (),
    ) -> None:
        self.cfg = cfg
        self.plan = Plan.build(cfg, meg, first_iteration)
        self.executor = executor
        self.op_kwargs = op_kwargs
        self.router = Router(
            load_balancing=cfg.codesign.load_balancing, on_demand=cfg.codesign.on_demand_allocation,
            num_mb=cfg.batch.num_micro_batches,
        )
        self.balancer = (
            InstanceBalancer(agents=meg.agent_names, threshold=cfg.codesign.balance_threshold,
                             est_s=self.router.est_s["rollout"])
            if cfg.codesign.load_balancing else None
        )
        self.on_op_done = on_op_done
        self.skip = set(skip)
        self.router.completed.update(self.skip)

    def run(self) -> RunResult:
        deps = self.plan.deps
        children: dict[Op, list[Op]] = defaultdict(list)
        for op, ds in deps.items():
            for d in ds:
                children[d].append(op)
        # Ops in `skip` completed in an earlier attempt (resume): they count as done.
        waiting = {op: sum(1 for d in ds if d not in self.skip) for op, ds in deps.items()}
        ready = sorted(op for op, n in waiting.items() if n == 0 and op not in self.skip)
        # One op per trainer at a time: its state lives in one worker's memory and accumulates.
        trainer_busy: set[str] = set()
        resubmits: dict[Op, int] = defaultdict(int)
        running: dict[Any, tuple[Op, float, Route]] = {}
        records: list[OpRecord] = []
        t0 = time.time()

        def complete(op: Op) -> None:
            for c in children[op]:
                waiting[c] -= 1
                if waiting[c] == 0 and c not in self.skip:
                    ready.append(c)

        total = len([op for op in deps if op not in self.skip])
        while len(records) < total:
            ready.sort()
            held: list[Op] = []
            if ready:
                workers = self._live_workers()
                if self.balancer is not None and any(op.kind == "rollout" for op in ready):
                    workers = self._rebalance(ready, running, workers)
            while ready:
                op = ready.pop(0)
                needs_trainer = op.kind in ("train", "step", "sync")
                if needs_trainer and op.agent in trainer_busy:
                    held.append(op)
                    continue
                route = self.router.route(op, workers)
                handle = self.executor.submit(op, self.op_kwargs(op), route)
                running[handle] = (op, time.time(), route)
                self.router.submitted(op, route.worker)
                if needs_trainer:
                    trainer_busy.add(op.agent)
            ready.extend(held)
            if not running:
                raise OrchestratorError(
                    f"deadlock: {total - len(records)} ops left but none runnable: "
                    f"{[o.name for o in ready][:5]}"
                )
            for handle in self.executor.wait_any(list(running)):
                op, submitted, route = running.pop(handle)
                self.router.finished(op, route.worker)
                if op.kind in ("train", "step", "sync"):
                    trainer_busy.discard(op.agent)
                try:
                    res = self.executor.result(handle)
                except Exception as exc:
                    lost = getattr(self.executor, "lost", None)
                    if lost is not None and lost(exc) and resubmits[op] < LOST_WORKER_RESUBMITS:
                        # Its worker died: every stage is idempotent and rebuilds its engine or
                        # trainer from published weights / checkpoints, so run it again elsewhere.
                        resubmits[op] += 1
                        self.router.decisions.append({
                            "t": time.time(), "decision": "resubmit", "op": op.name,
                            "worker": route.worker, "error": f"{type(exc).__name__}: {exc}"[:300],
                        })
                        ready.append(op)
                        continue
                    raise OrchestratorError(f"{op.name} failed: {exc}") from exc
                rec = OpRecord(op, submitted, time.time(), res.get("worker"), res)
                records.append(rec)
                self.router.completed.add(op)
                if "t_end" in res:
                    # Swap-in time is the move's cost, not the op's: keep it out of the estimate.
                    # (The balancer reads the rollout estimates from the same table.)
                    self.router.observe(op, res["t_end"] - res["t_start"] - res.get("swap_in_s", 0.0))
                if self.on_op_done:
                    self.on_op_done(rec)
                complete(op)
        return RunResult(records=records, wall_s=time.time() - t0, started=t0,
                         decisions=sorted(self.router.decisions, key=lambda d: d["t"]))

    def _rebalance(
        self, ready: list[Op], running: dict[Any, tuple[Op, float, Route]], workers: dict[str, dict[str, float]]
    ) -> dict[str, dict[str, float]]:
        """Inter-agent balancing before a submission wave: move instances (re-tag workers)
        until the balancer sees no disparity worth a move. Only dedicated `rollout:<agent>`
        tags move; a cluster of shared `rollout` workers has nothing to rebalance."""
        assert self.balancer is not None
        agents = self.balancer.agents
        prefix = f"{ROLLOUT_TAG}:"
        rollout_workers = [w for w, r in workers.items() if any(k.startswith(prefix) for k in r)]
        if not rollout_workers:
            return workers
        workers = {w: dict(r) for w, r in workers.items()}
        instances = {a: [w for w in rollout_workers if workers[w].get(rollout_tag(a), 0) > 0] for a in agents}
        queued: dict[str, int] = defaultdict(int)
        in_use: set[tuple[str, str]] = set()
        for op, _, route in running.values():
            if op.kind == "rollout":
                queued[op.agent] += 1
                if route.worker:
                    in_use.add((route.worker, op.agent))
        for op in ready:
            if op.kind == "rollout":
                queued[op.agent] += 1
        for _ in range(len(rollout_workers) * len(agents)):  # bounded: each move changes a tag
            load = {w: self.router.work[w] for w in rollout_workers}
            move = self.balancer.step(queued, instances, load, in_use)
            if move is None:
                break
            tags = {rollout_tag(move.to_agent): 1.0}
            if move.from_agent is not None:
                tags[rollout_tag(move.from_agent)] = 0.0
            self.executor.set_worker_resources(move.worker, tags)
            workers[move.worker].update(tags)
            apply_move(instances, move)
            self.router.decisions.append({"decision": "move_instance", **move.as_dict()})
        return workers

    def _live_workers(self, patience_s: float = 60.0) -> dict[str, dict[str, float]]:
        """Current worker tags. No workers at all means the cluster is (re)starting one, so
        wait for it; workers that lack a tag are a config error the router reports at once."""
        deadline = time.time() + patience_s
        while True:
            workers = self.executor.worker_resources()
            if workers or time.time() > deadline:
                return workers
            time.sleep(0.5)
