"""Training slots: which worker runs an agent's trainer ops (train, step, sync) each iteration.

An agent's trainer accumulates gradients in one worker's memory, so its ops of one iteration
run on one worker. Static placement (no `on_demand_allocation`) fixes that worker for the run,
spreading trainers over the `train` slots in agent order. On demand, each agent's iteration
takes the slot with the least work when its first micro-batch is ready, preferring the worker
that already holds the state; elsewhere the worker swaps the state in from its last checkpoint.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from flexmarl_core.control.decisions import Decision, TrainSlot
from flexmarl_core.control.ledger import WorkLedger
from flexmarl_core.ops import Op


@dataclass
class SlotAllocator:
    ledger: WorkLedger
    on_demand: bool
    #: micro-batches per iteration (an allocation reserves that many train ops)
    num_mb: int
    clock: Callable[[], float]
    log: list[Decision]
    #: where each agent's trainer state was last (static: its home for the run)
    home: dict[str, str] = field(default_factory=dict)
    #: on demand: the slot of each (agent, iteration)
    slot: dict[tuple[str, int], str] = field(default_factory=dict)
    #: a slot that already holds the state wins unless another has this much less work
    SWAP_PENALTY_S: ClassVar[float] = 0.2

    def choose(self, op: Op, slots: list[str]) -> str:
        return self._on_demand(op, slots) if self.on_demand else self._static(op, slots)

    def _static(self, op: Op, slots: list[str]) -> str:
        home = self.home.get(op.agent)
        if home is None or home not in slots:
            taken: dict[str, int] = defaultdict(int)
            for w in self.home.values():
                taken[w] += 1
            home = min(slots, key=lambda w: (taken[w], w))
            self.home[op.agent] = home
        return home

    def _on_demand(self, op: Op, slots: list[str]) -> str:
        key = (op.agent, op.iteration)
        slot = self.slot.get(key)
        if slot is not None and slot in slots:
            return slot
        work = self.ledger.work
        last = self.home.get(op.agent)
        slot = min(slots, key=lambda w: (work[w] - (self.SWAP_PENALTY_S if w == last else 0.0), w))
        self.slot[key] = slot
        self.log.append(TrainSlot(
            t=self.clock(), agent=op.agent, iteration=op.iteration, worker=slot, state_was_on=last,
            swap=last is not None and last != slot,
            loads={w: self.ledger.outstanding[w] for w in slots},
            work_s={w: round(work[w], 3) for w in slots},
        ))
        self.home[op.agent] = slot
        self._reserve(op, slot)
        return slot

    def _reserve(self, op: Op, slot: str) -> None:
        """Charge the slot the agent's whole iteration of training now, so the next allocation
        sees it before those ops are ready. A re-allocation (the slot's worker is gone) moves
        what is still charged to the old slot."""
        ops = [Op(op.iteration, "train", op.agent, mb=j) for j in range(self.num_mb)]
        ops += [Op(op.iteration, "step", op.agent), Op(op.iteration, "sync", op.agent)]
        for t in ops:
            if t in self.ledger.completed:
                continue
            old = self.ledger.uncharge(t)
            self.ledger.charge(t, slot, old if old is not None else self.ledger.estimate(t.kind, op.agent))
