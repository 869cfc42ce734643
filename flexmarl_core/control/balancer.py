"""The control plane's inter-agent load balancer: moves inference instances between agents.

An instance of agent A is a worker tagged `rollout:A` (one worker may host instances of several
agents). The orchestrator calls the balancer each time it is about to submit work:

    loads = balancer.monitor(queued, instances)      # seconds of queued rollout work per instance
    move = balancer.decide(loads, instances, queued, worker_load)
    if move: retag(move.worker, ...)                 # re-tag; weights load lazily there

(`rebalance` below runs that loop before each submission wave.)

A program team's ops call every agent: each ready or running program op counts as one queued
unit of every agent, weighed by the agent's decode seconds per program op.

Load is measured in seconds, not task counts, so an agent that writes longer outputs (or is
called more often) weighs more: queued rollouts x the agent's recent rollout duration, divided
by its number of instances. When the hottest agent's load exceeds `threshold` times the coldest
one's, the coldest agent gives up an instance on a worker that does not serve the hottest yet.
An agent never loses its last instance while it has queued work; one with queued work and no
instance at all is served first (infinite load).

Hysteresis: an instance moved to an agent is not taken away again before a rollout of that
agent was routed to it (`fresh`), and no move is made that would leave the donor hotter than
the hot agent (`_flips`). Without them, on the simulated math shape, the next wave sometimes
moved an instance back before it had served (its weights loaded for nothing).

LoRA agents on one base (`base_of`): a worker that already serves an agent on the hot agent's
base loads only the adapter, so a move there costs `weight_bytes` (the adapter) instead of
that plus `base_bytes`; among equally loaded workers the cheaper move wins, and each move
records its cost. Pure Python, no Dask: `bench/control_plane.py`
times `monitor` and `decide`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flexmarl_core.control.decisions import MoveInstance
from flexmarl_core.control.tags import ROLLOUT_TAG, rollout_tag
from flexmarl_core.ops import Op, Route, traits


@dataclass
class InstanceBalancer:
    """Decides instance moves from queued work per agent; keeps the estimates it needs."""

    agents: Sequence[str]
    threshold: float = 2.0
    #: bytes of each agent's weights (cost of bringing an instance up)
    weight_bytes: Mapping[str, int] = field(default_factory=dict)
    #: LoRA agents: agent -> key of its base model (agents without one are full models)
    base_of: Mapping[str, str] = field(default_factory=dict)
    #: bytes of each base model (loaded once per worker, whichever agent on it comes first)
    base_bytes: Mapping[str, int] = field(default_factory=dict)
    #: exponential moving average of each agent's rollout duration (s)
    est_s: dict[str, float] = field(default_factory=dict)
    alpha: float = 0.5
    #: (worker, agent) pairs moved in that have not been routed a rollout of the agent yet: not
    #: taken away again before they served once (the weights were loaded for it)
    fresh: set[tuple[str, str]] = field(default_factory=set)
    #: an agent's rollout seconds before it was measured (the work ledger's warm estimate)
    prior: Callable[[str], float] | None = None

    def observe(self, agent: str, duration_s: float) -> None:
        """Feed one finished rollout's duration into the agent's estimate."""
        prev = self.est_s.get(agent)
        self.est_s[agent] = duration_s if prev is None else (1 - self.alpha) * prev + self.alpha * duration_s

    def _est(self, agent: str) -> float:
        if agent in self.est_s:
            return self.est_s[agent]
        if self.prior is not None:
            return self.prior(agent)
        # Before an agent's first rollout: the mean of the others (or 1 s), so it is comparable.
        return sum(self.est_s.values()) / len(self.est_s) if self.est_s else 1.0

    def move_cost(self, worker: str, agent: str, instances: Mapping[str, Sequence[str]]) -> int:
        """Bytes to load for an instance of `agent` on `worker`: its weights (a LoRA agent: its
        adapter), plus its base unless an agent the worker serves runs on the same base."""
        cost = int(self.weight_bytes.get(agent, 0))
        base = self.base_of.get(agent)
        if base is None:
            return cost
        shares = any(self.base_of.get(a) == base for a, ws in instances.items() if a != agent and worker in ws)
        return cost if shares else cost + int(self.base_bytes.get(base, 0))

    def monitor(self, queued: Mapping[str, int], instances: Mapping[str, Sequence[str]]) -> dict[str, float]:
        """Seconds of queued+running rollout work per instance, per agent."""
        loads: dict[str, float] = {}
        for a in self.agents:
            q = queued.get(a, 0)
            n = len(instances.get(a, ()))
            if q == 0:
                loads[a] = 0.0
            elif n == 0:
                loads[a] = math.inf
            else:
                loads[a] = q * self._est(a) / n
        return loads

    def decide(
        self,
        loads: Mapping[str, float],
        instances: Mapping[str, Sequence[str]],
        queued: Mapping[str, int],
        worker_load: Mapping[str, float],
        in_use: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
    ) -> tuple[str, str, str | None] | None:
        """The move to make now, as (worker, to_agent, from_agent), or None.

        `worker_load` is the work already waiting on each rollout-capable worker (any agent);
        among the workers that could take the hot agent, the least loaded is chosen. `in_use`
        holds (worker, agent) pairs with tasks queued there: such a tag is never taken away
        (Dask leaves a task that already waits on a tag stuck when the tag goes away), the
        worker is shared instead.
        """
        if not loads:
            return None
        hot = max(loads, key=lambda a: (loads[a], a))
        if loads[hot] <= 0 or (queued.get(hot, 0) <= len(instances.get(hot, ())) and loads[hot] != math.inf):
            return None  # every queued task of the hottest agent already has an instance to itself
        hot_on = set(instances.get(hot, ()))
        hot_load = loads[hot]
        # The least-loaded worker that can take the hot agent wins; ties in load go to the
        # cheapest move (a worker that already holds hot's base). One sort, then the first
        # that qualifies: O(workers log workers) however many are passed over.
        candidates = sorted((w for w in worker_load if w not in hot_on),
                            key=lambda c: (worker_load[c], self.move_cost(c, hot, instances)))
        hosted_by: dict[str, list[str]] = defaultdict(list)
        for a, ws in instances.items():
            for w in ws:
                hosted_by[w].append(a)
        for w in candidates:
            # The agent on `w` to take the instance from: the coldest one that can spare it.
            donor = min((a for a in hosted_by.get(w, ()) if (w, a) not in self.fresh),
                        key=lambda a: (loads.get(a, 0.0), a), default=None)
            if donor is None and hosted_by.get(w):
                continue  # every agent there was just moved in: no second move before it served
            donor_load = loads.get(donor, 0.0) if donor else 0.0
            if not (hot_load == math.inf or hot_load > self.threshold * donor_load) or \
                    self._flips(hot, donor, loads, instances, queued):
                continue
            if donor is not None and (
                (w, donor) in in_use or (len(instances[donor]) <= 1 and queued.get(donor, 0) > 0)
            ):
                donor = None  # keep its last instance while it has work: share the worker instead
            return w, hot, donor
        return None

    def _flips(self, hot: str, donor: str | None, loads: Mapping[str, float],
               instances: Mapping[str, Sequence[str]], queued: Mapping[str, int]) -> bool:
        """Whether taking an instance from `donor` would leave it hotter than `hot` (the next
        wave would move it back: hysteresis)."""
        n_d = len(instances.get(donor, ())) if donor else 0
        if donor is None or n_d <= 1 or queued.get(donor, 0) == 0 or loads[hot] == math.inf:
            return False
        after_hot = queued.get(hot, 0) * self._est(hot) / (len(instances.get(hot, ())) + 1)
        after_donor = queued[donor] * self._est(donor) / (n_d - 1)
        return after_donor > after_hot

    def step(
        self,
        queued: Mapping[str, int],
        instances: Mapping[str, Sequence[str]],
        worker_load: Mapping[str, float],
        in_use: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
        now: float | None = None,
    ) -> MoveInstance | None:
        """monitor + decide, timed; returns the move (not yet applied) or None."""
        t0 = time.perf_counter()
        loads = self.monitor(queued, instances)
        t1 = time.perf_counter()
        d = self.decide(loads, instances, queued, worker_load, in_use)
        t2 = time.perf_counter()
        if d is None:
            return None
        worker, to_agent, from_agent = d
        return MoveInstance(
            t=time.time() if now is None else now, worker=worker, to_agent=to_agent,
            from_agent=from_agent, loads=dict(loads), cost_bytes=self.move_cost(worker, to_agent, instances),
            monitor_us=(t1 - t0) * 1e6, decide_us=(t2 - t1) * 1e6,
        )


def apply_move(instances: dict[str, list[str]], move: MoveInstance) -> None:
    """Update an `agent -> workers` view in place after a move."""
    instances.setdefault(move.to_agent, []).append(move.worker)
    if move.from_agent is not None:
        instances[move.from_agent] = [w for w in instances.get(move.from_agent, []) if w != move.worker]


def rebalance(
    balancer: InstanceBalancer,
    ready: Iterable[Op],
    running: Iterable[tuple[Op, Route]],
    workers: dict[str, dict[str, float]],
    worker_load: Mapping[str, float],
    retag: Callable[[str, dict[str, float]], None],
    now: float,
) -> tuple[dict[str, dict[str, float]], list[MoveInstance]]:
    """Move instances (re-tag workers) until the balancer sees no disparity worth a move;
    returns the workers' tags afterwards and the moves made. Only dedicated `rollout:<agent>`
    tags move: a cluster of shared `rollout` workers has nothing to rebalance."""
    prefix = f"{ROLLOUT_TAG}:"
    rollout_workers = [w for w, r in workers.items() if any(k.startswith(prefix) for k in r)]
    if not rollout_workers:
        return workers, []
    workers = {w: dict(r) for w, r in workers.items()}
    agents = balancer.agents
    # One pass over each worker's tags (agents x workers lookups took 13 ms a wave at 100 agents
    # on 192 instances).
    instances: dict[str, list[str]] = {a: [] for a in agents}
    for w in rollout_workers:
        for tag, n in workers[w].items():
            if n > 0 and tag.startswith(prefix) and tag[len(prefix):] in instances:
                instances[tag[len(prefix):]].append(w)
    queued: dict[str, int] = defaultdict(int)
    in_use: set[tuple[str, str]] = set()
    for op, route in running:
        if traits(op.kind).placement == "instance":
            queued[op.agent] += 1
            if route.worker:
                in_use.add((route.worker, op.agent))
    for op in ready:
        if traits(op.kind).placement == "instance":
            queued[op.agent] += 1
    # A host op (a program op) calls every agent: it queues one unit of each agent's decode
    # work (the estimate is the agent's decode seconds per program op); its decodes are pinned
    # to a worker when they start, so no tag of theirs is ever in use.
    hosted = [op for op, _ in running] + list(ready)
    programs = sum(1 for op in hosted if traits(op.kind).placement == "host")
    for a in agents if programs else ():
        queued[a] += programs
    moves = []
    loads = {w: worker_load.get(w, 0.0) for w in rollout_workers}  # a move does not change them
    for _ in range(len(rollout_workers) * len(agents)):  # bounded: each move changes a tag
        move = balancer.step(queued, instances, loads, in_use, now=now)
        if move is None:
            break
        tags = {rollout_tag(move.to_agent): 1.0}
        if move.from_agent is not None:
            tags[rollout_tag(move.from_agent)] = 0.0
        retag(move.worker, tags)
        workers[move.worker].update(tags)
        apply_move(instances, move)
        balancer.fresh.add((move.worker, move.to_agent))
        moves.append(move)
    return workers, moves


def lend_idle(
    ready: Iterable[Op],
    workers: dict[str, dict[str, float]],
    outstanding: Mapping[str, int],
    retag: Callable[[str, dict[str, float]], None],
    now: float,
) -> tuple[dict[str, dict[str, float]], list[MoveInstance]]:
    """Late binding: each ready rollout (in the order given) whose agent has no idle instance
    gets an idle rollout worker's tag added (shared, nothing taken away), so no worker idles
    while a rollout waits. Idle: nothing outstanding there. Returns the tags and the moves."""
    prefix = f"{ROLLOUT_TAG}:"
    idle = [w for w, r in sorted(workers.items())
            if outstanding.get(w, 0) == 0 and any(k.startswith(prefix) and v > 0 for k, v in r.items())]
    if not idle:
        return workers, []
    workers = {w: dict(r) for w, r in workers.items()}
    moves = []
    for op in ready:
        if not idle:
            break
        if traits(op.kind).placement != "instance":
            continue
        tag = rollout_tag(op.agent)
        if not any(r.get(tag, 0) > 0 for r in workers.values()):
            continue  # served by shared `rollout` workers: the router picks among them
        own = [w for w in idle if workers[w].get(tag, 0) > 0]
        w = own[0] if own else idle[0]
        idle.remove(w)
        if not own:
            retag(w, {tag: 1.0})
            workers[w][tag] = 1.0
            moves.append(MoveInstance(t=now, worker=w, to_agent=op.agent, from_agent=None, loads={},
                                      cost_bytes=0, monitor_us=0.0, decide_us=0.0))
    return workers, moves
