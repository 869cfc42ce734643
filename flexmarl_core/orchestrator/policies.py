"""Submission policies beside the orchestrator's loop: which op goes to the executor when, and
in what shape. The loop keeps its own rules (ready ops, one op per trainer, lost-worker
resubmits, records); each policy here reads the loop's `Schedule` and the control plane.

- `LateBinding` (`codesign.late_binding`): the order of a submission wave, and which rollouts
  wait for an idle instance.
- `LookAhead` (`cluster.look_ahead`, an executor that chains): ops whose dependencies are all
  submitted go at once, chained on them.
- `Fusing` (`cluster.fuse_chains`, an executor that fuses): an op takes along the chain that
  follows it on the same worker, as one task.

Late binding rules out the other two: it decides where a rollout runs when a worker frees, and
an op chained or fused ahead would count against an idle worker and keep it from taking one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.control import ControlPlane
from flexmarl_core.executors.api import ChainingExecutor, Executor, FusingExecutor
from flexmarl_core.meg import NodeKey
from flexmarl_core.ops import Op, Route, on_trainer, traits
from flexmarl_core.orchestrator.plan import Plan

#: The most ops fused into one run (a chain is cut at its iteration's end anyway).
MAX_FUSED = 16
#: Worker tags by worker, as the executor reports them.
Workers = dict[str, dict[str, float]]


@dataclass
class Running:
    """One submitted task: an op, or a fused chain of ops headed by `op`."""

    op: Op
    submitted: float
    route: Route
    #: look-ahead: the dependencies it was chained on that have not ended yet (as seen here)
    pending: set[Op] = field(default_factory=set)
    #: fused: the ops that run after `op` in the same task, each with its own route
    tail: list[tuple[Op, Route]] = field(default_factory=list)
    #: seconds after `since` at which it counts as hung (`ControlPlane.deadline`)
    deadline_s: float = float("inf")
    #: when its clock started: submission, or when the last op it was chained on ended
    since: float = 0.0

    @property
    def ops(self) -> list[tuple[Op, Route]]:
        return [(self.op, self.route), *self.tail]


@dataclass
class Schedule:
    """The loop's state, as the policies read it (the orchestrator alone changes it)."""

    deps: dict[Op, list[Op]]
    #: ops an earlier attempt completed (resume): they count as done
    skip: set[Op]
    children: defaultdict[Op, list[Op]] = field(default_factory=lambda: defaultdict(list))
    #: per op, how many of its dependencies have not been recorded yet
    waiting: dict[Op, int] = field(default_factory=dict)
    ready: list[Op] = field(default_factory=list)
    recorded: set[Op] = field(default_factory=set)
    #: handle -> the task behind it; op -> the handle of the task it runs in
    running: dict[Any, Running] = field(default_factory=dict)
    handle: dict[Op, Any] = field(default_factory=dict)
    #: agent -> its trainer ops submitted and not ended (one trainer op at a time)
    trainer_ops: defaultdict[str, set[Op]] = field(default_factory=lambda: defaultdict(set))
    #: every op of the iterations before it is done (their state is forgotten)
    floor: int = 0

    def done(self, op: Op) -> bool:
        """Recorded in this run, or done by an earlier attempt."""
        return op.iteration < self.floor or op in self.recorded or op in self.skip


class LateBinding:
    """Rollouts wait in the orchestrator until an instance of their agent has nothing queued
    (the router returns no route until then). Per iteration, trainer and reward ops go first
    (they lead to the weight sync the next iteration waits for), then rollouts of the deepest
    MEG nodes first: a verifier's turn on a finished micro-batch releases its reward and
    training, which otherwise pile up behind the solver's long turns. Replayed on 7 long-tail
    runs' measured ops (`analysis.bound.replay`), this beat roots-first by 1% on average at 4
    micro-batches and by 10% at 8."""

    def __init__(self, plan: Plan) -> None:
        depth: dict[NodeKey, int] = {}

        def d(node: NodeKey) -> int:
            if node not in depth:
                depth[node] = 1 + max((d(p) for p in plan.meg.parents[node]), default=-1)
            return depth[node]

        self._depth = d
        self._rewards_pending = False

    def key(self, op: Op) -> tuple:
        if traits(op.kind).placement != "instance":
            return (op.iteration, 0, 0, op)
        return (op.iteration, 1, -self._depth(NodeKey(op.agent, op.turn)), op)

    def begin_wave(self, state: Schedule) -> None:
        """Note whether an op that scores (a reward) is ready or running: its train ops are
        about to want a worker, and a rollout started now would hold the one that is free for
        its whole length."""
        self._rewards_pending = any(traits(o.kind).scores for o in [*state.ready, *(r.op for r in state.running.values())])

    def holds(self, op: Op) -> bool:
        return traits(op.kind).placement == "instance" and self._rewards_pending


class LookAhead:
    """An op whose dependencies are all submitted, and whose route no later decision could
    change (`ControlPlane.route_ahead`), is submitted at once, chained on its running
    dependencies, so the cluster starts it the moment they end instead of after a round trip
    through the loop. One level deep: only the children of ops that can run now, which bounds
    it to the next op of each chain. A chained op whose dependency is lost goes back to
    waiting; one whose dependency failed fails with it (the dependency's error is raised)."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control

    def ahead(self, state: Schedule, live_workers: Callable[[], Workers]) -> Iterator[tuple[Op, Route, set[Op]]]:
        """(op, route, the dependencies it is chained on) to submit now, one at a time: the
        caller submits each before asking for the next (the state moves on in between)."""
        workers: Workers | None = None
        for run in list(state.running.values()):
            if run.pending:
                continue
            for c in (c for o, _ in run.ops for c in state.children[o]):
                if c in state.handle or c in state.skip or state.waiting[c] == 0:
                    continue  # running, done earlier, or ready (the ready path takes it)
                pending = {d for d in state.deps[c] if not state.done(d)}
                if any(d not in state.handle or state.running[state.handle[d]].pending for d in pending):
                    continue  # a dependency not submitted yet, or itself chained: too far ahead
                if on_trainer(c.kind) and not state.trainer_ops[c.agent] <= pending:
                    continue  # the trainer is busy with an op it does not wait for
                workers = workers if workers is not None else live_workers()
                route = self.control.route_ahead(c, workers)
                if route is not None:
                    yield c, route, pending


class Fusing:
    """An op submitted with a fixed route takes along the chain that follows it within its
    iteration, one task for all, while each next op is the only one its predecessor releases,
    has no other dependency left, and would run on the same worker anyway. The chain then pays
    one dispatch and one scheduler transition instead of one per op; each op still has its own
    record, task run and retries. A fused run that stops at a failed op returns the ones before
    it; the rest go back to waiting."""

    def __init__(self, control: ControlPlane, max_ops: int = MAX_FUSED) -> None:
        self.control = control
        self.max_ops = max_ops

    def tail(self, state: Schedule, head: Op, route: Route, workers: Workers | None, before: set[Op],
             live_workers: Callable[[], Workers]) -> tuple[list[tuple[Op, Route]], dict[str, float]]:
        """The chain after `head` that can run in its task, and the resources the task needs
        (the union of its ops'): each next op is the only unfinished child of the one before,
        within the iteration, waits for nothing outside the chain (`before`: the ops of the
        runs `head` is chained on, which end before it starts), and its fixed route is the same
        place (the same pinned worker; or, unpinned, resources some one worker has together
        with the head's)."""
        tail: list[tuple[Op, Route]] = []
        chain, last, need = {head}, head, dict(route.resources)
        while len(chain) < self.max_ops:
            kids = [c for c in state.children[last] if not state.done(c)]
            if len(kids) != 1:
                break
            c = kids[0]
            if c.iteration != head.iteration or c in state.handle:
                break
            if any(d not in chain and not state.done(d) for d in state.deps[c]):
                break
            if on_trainer(c.kind) and not state.trainer_ops[c.agent] <= chain | before:
                break  # the trainer is busy with an op that may still run alongside
            workers = workers if workers is not None else live_workers()
            r = self.control.route_ahead(c, workers)
            if r is None or (r.worker is not None and r.worker != route.worker):
                break
            grown = {**need, **{k: max(v, need.get(k, 0.0)) for k, v in r.resources.items()}}
            fits = [w for w, res in workers.items() if all(res.get(k, 0) >= v for k, v in grown.items())]
            if (route.worker is not None and route.worker not in fits) or (route.worker is None and len(fits) != 1):
                break  # not the same place (unpinned: Dask could place them apart)
            need = grown
            tail.append((c, r))
            chain.add(c)
            last = c
        return tail, need


@dataclass
class Policies:
    """The submission policies a run uses (None: off)."""

    late_binding: LateBinding | None = None
    look_ahead: LookAhead | None = None
    fusing: Fusing | None = None


def policies_for(plan: Plan, cfg: ExperimentConfig, executor: Executor, control: ControlPlane) -> Policies:
    """The policies `cfg` asks for (`cluster.look_ahead`, `cluster.fuse_chains`, late binding)
    that `executor` can carry out."""
    if control.late_binding:
        return Policies(late_binding=LateBinding(plan))
    ahead, fusing = cfg.cluster.look_ahead, cfg.cluster.fuse_chains
    return Policies(
        look_ahead=LookAhead(control) if ahead and isinstance(executor, ChainingExecutor) else None,
        fusing=Fusing(control) if fusing and isinstance(executor, FusingExecutor) else None,
    )
