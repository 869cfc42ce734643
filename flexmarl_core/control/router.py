"""Routing: where each op runs, chosen at the moment it is submitted (a Dask task already
waiting on a tag would not move).

Rollouts go to an instance of their agent: a worker tagged `rollout:<agent>`, else any worker
tagged `rollout`. With `load_balancing` the instance with the least work is chosen (intra-agent
balancing; `InstanceBalancer` moves instances between agents); without it, Dask places the task
among the tagged workers. Trainer ops go to the agent's training slot (`SlotAllocator`);
rewards anywhere. With `gradient_helpers`, a train op whose slot is busy goes to an idle slot
instead, as a gradient helper (`Route.gradient_only`). With `late_binding` a rollout goes only to an instance with nothing
outstanding (or fewer than its `rollout_slots`), and `route` returns None (hold it) while there
is none: a Dask task queued behind a long rollout could not move to the worker that frees first.

A program team's `program(it, mb)` ops run at most one per rollout instance at once (`route`
returns None for the rest): started together, a batch's micro-batches would share the CPU and
all finish late, so no agent could train on one while the others roll out.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flexmarl_core.control.allocation import SlotAllocator
from flexmarl_core.control.decisions import Decision, GradientHelper
from flexmarl_core.control.ledger import WorkLedger
from flexmarl_core.control.tags import ROLLOUT_TAG, TRAIN_TAG, is_rollout_tag, rollout_tag
from flexmarl_core.ops import Op, Route, traits


class OrchestratorError(RuntimeError):
    """The run cannot go on; the message names the op and the reason."""


class Router:
    def __init__(
        self,
        *,
        load_balancing: bool,
        on_demand: bool = False,
        late_binding: bool = False,
        num_mb: int = 1,
        clock: Callable[[], float] = time.time,
        log: list[Decision] | None = None,
        helper_agents: frozenset[str] = frozenset(),
        rollout_slots: Callable[[str], int] | None = None,
    ) -> None:
        self.load_balancing = load_balancing
        #: rollouts a worker may hold now under late binding (default 1): an instance whose
        #: replicas are released one by one takes a second while the first's last replicas decode
        self.rollout_slots = rollout_slots or (lambda worker: 1)
        #: agents whose train ops may run as gradient helpers (`codesign.gradient_helpers`)
        self.helper_agents = helper_agents
        self.clock = clock
        self.late_binding = late_binding and load_balancing
        self.ledger = WorkLedger()
        self.decisions: list[Decision] = [] if log is None else log
        self.slots = SlotAllocator(self.ledger, on_demand, num_mb, clock, self.decisions)

    def instances(self, agent: str, workers: dict[str, dict[str, float]]) -> tuple[str, list[str]]:
        """The tag an agent's rollouts need now, and the workers that carry it."""
        dedicated = [w for w, r in workers.items() if r.get(rollout_tag(agent), 0) > 0]
        if dedicated:
            return rollout_tag(agent), sorted(dedicated)
        shared = [w for w, r in workers.items() if r.get(ROLLOUT_TAG, 0) > 0]
        return ROLLOUT_TAG, sorted(shared)

    def route(self, op: Op, workers: dict[str, dict[str, float]]) -> Route | None:
        """Where `op` runs, by its kind's placement (`ops.KindTraits`); None: hold it for now.
        A kind without traits is an error, never placed as a guess."""
        try:
            placement = traits(op.kind).placement
        except ValueError as exc:
            raise OrchestratorError(f"{op.name}: {exc}") from None
        if placement == "instance":
            tag, candidates = self.instances(op.agent, workers)
            if not candidates:
                raise OrchestratorError(
                    f"{op.name}: no worker has resource tag {rollout_tag(op.agent)!r} or "
                    f"{ROLLOUT_TAG!r}; workers: {workers}. Add the tag to a worker in cluster.workers."
                )
            if not self.load_balancing:
                return Route({tag: 1})
            led = self.ledger
            if self.late_binding:
                candidates = [w for w in candidates if led.outstanding[w] < self.rollout_slots(w)]
                if not candidates:
                    return None
            worker = min(candidates, key=lambda w: (led.work[w], led.outstanding[w], w))
            return Route({tag: 1}, worker)
        if placement == "trainer":
            slots = sorted(w for w, r in workers.items() if r.get(TRAIN_TAG, 0) > 0)
            if not slots:
                raise OrchestratorError(f"{op.name}: no worker has resource tag {TRAIN_TAG!r}; workers: {workers}")
            slot = self.slots.choose(op, slots)
            if self.may_help(op):
                helper = self._helper(op, slot, slots)
                if helper is not None:
                    return Route({TRAIN_TAG: 1}, helper, gradient_only=True)
            return Route({TRAIN_TAG: 1}, slot)
        if placement == "host":
            instances = sum(1 for r in workers.values() if any(is_rollout_tag(t) for t, n in r.items() if n > 0))
            if self.ledger.hosting >= max(instances, 1):
                return None  # held until a running host op ends
            return Route({})  # its decodes go to the agents' instances (the host's dispatcher)
        return Route({})  # anywhere: cheap

    def may_help(self, op: Op) -> bool:
        """Whether `op` may run as a gradient helper (a train op of a `helper_agents` agent)."""
        return traits(op.kind).trains and op.agent in self.helper_agents

    def _helper(self, op: Op, slot: str, slots: list[str]) -> str | None:
        """An idle slot to compute `op`'s gradient while the trainer's own slot is busy (it
        would queue there behind its agent's other train ops), else None. Its work moves
        with it in the ledger."""
        led = self.ledger
        idle = [w for w in slots if w != slot and led.outstanding[w] == 0]
        if led.outstanding[slot] == 0 or not idle:
            return None
        worker = min(idle, key=lambda w: (led.work[w], w))
        secs = led.uncharge(op)
        led.charge(op, worker, secs if secs is not None else led.estimate("train", op.agent))
        self.decisions.append(GradientHelper(t=self.clock(), agent=op.agent, iteration=op.iteration, mb=op.mb,
                                             worker=worker, slot=slot, queued=led.outstanding[slot]))
        return worker
