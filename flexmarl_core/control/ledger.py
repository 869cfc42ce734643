"""The control plane's view of load: seconds of work routed to each worker and not finished.

Each op is charged its kind's and agent's recent measured duration (`observe`) to the worker
it goes to; an on-demand allocation charges a slot the agent's whole iteration of training up
front. Counting tasks instead put a solver's 2.8 s micro-batches level with a planner's 1.6 s
ones, and an iteration's training piled onto one worker while the other idled (measured: 4.6 s
per iteration).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from flexmarl_core.ops import Op

#: op seconds assumed before an op kind was measured (a train micro-batch ~ 2 rollouts on CPU)
DEFAULT_OP_S: dict[str, float] = {"rollout": 1.0, "reward": 0.05, "train": 2.0, "step": 0.05, "sync": 0.05,
                                  "program": 3.0, "value": 0.5}


@dataclass
class WorkLedger:
    #: ops routed to each worker and not finished
    outstanding: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: estimated seconds of work routed to each worker and not finished (plus reservations)
    work: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: kind -> agent -> moving average of measured op seconds (the rollout table is also the
    #: InstanceBalancer's, so both read one estimate)
    est_s: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    #: op -> (worker, seconds) charged to that worker until the op finishes
    charges: dict[Op, tuple[str, float]] = field(default_factory=dict)
    #: ops already done (in this run, or an earlier attempt when resuming): never charged again
    completed: set[Op] = field(default_factory=set)
    #: op kind -> ops of that kind submitted and not finished (pinned to a worker or not)
    running: dict[str, int] = field(default_factory=lambda: defaultdict(int))

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
        self.running[op.kind] += 1
        if worker is None:
            return
        self.outstanding[worker] += 1
        if op not in self.charges:  # trainer ops of an allocation were charged up front
            self.charge(op, worker, self.estimate(op.kind, op.agent))

    def finished(self, op: Op, worker: str | None) -> None:
        self.running[op.kind] -= 1
        if worker is not None:
            self.outstanding[worker] -= 1
        self.uncharge(op)

    def charge(self, op: Op, worker: str, secs: float) -> None:
        self.charges[op] = (worker, secs)
        self.work[worker] += secs

    def uncharge(self, op: Op) -> float | None:
        """Drop `op`'s charge; the seconds it was charged, or None if it had none."""
        old = self.charges.pop(op, None)
        if old is None:
            return None
        self.work[old[0]] = max(self.work[old[0]] - old[1], 0.0)
        return old[1]
