"""The control plane's view of load: seconds of work routed to each worker and not finished.

Each op is charged its kind's and agent's recent measured duration (`observe`) to the worker
it goes to; an on-demand allocation charges a slot the agent's whole iteration of training up
front. Counting tasks instead put a solver's 2.8 s micro-batches level with a planner's 1.6 s
ones, and an iteration's training piled onto one worker while the other idled (measured: 4.6 s
per iteration).

Estimates start warm. Before an agent's first op of a kind, its estimate is a measured agent's
scaled by their sizes (`sizes`: an op's work in tokens, from the prompts and response lengths
the config implies, or the simulator's cost model), so a planner with short prompts is not
charged a long-context solver's seconds; before any op of the kind, the default is scaled the
same way. A resumed run replays its earlier attempt's op log into the estimates
(`ControlPlane.warm`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from flexmarl_core.meg import MEG
from flexmarl_core.ops import Op, traits

#: a prompt token's share of a generated one's cost in a rollout: prefill runs the whole prompt
#: in one forward, decoding runs a forward per token
PREFILL_WEIGHT = 0.1


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

    #: kind -> agent -> an op's expected work (any unit, compared within a kind): scales the
    #: estimate of an agent not measured yet; kinds absent here are the same size for all agents
    sizes: dict[str, dict[str, float]] = field(default_factory=dict)

    #: kind -> mean seconds per size unit over the measured agents (dropped on each observation)
    _rate: dict[str, float | None] = field(default_factory=dict, init=False, repr=False)

    def estimate(self, kind: str, agent: str) -> float:
        per_agent = self.est_s.get(kind, {})
        if agent in per_agent:
            return per_agent[agent]
        size = self.sizes.get(kind, {})
        if agent not in size:
            return sum(per_agent.values()) / len(per_agent) if per_agent else traits(kind).guess_s
        if per_agent:  # seconds per unit of the measured agents, at this agent's size
            rate = self._mean_rate(kind)
            return size[agent] * rate if rate is not None else sum(per_agent.values()) / len(per_agent)
        return traits(kind).guess_s * size[agent] / (sum(size.values()) / len(size))

    def _mean_rate(self, kind: str) -> float | None:
        # Once per observation, not per call: a placement wave asks for every agent.
        if kind not in self._rate:
            size = self.sizes.get(kind, {})
            rates = [s / size[a] for a, s in self.est_s.get(kind, {}).items() if size.get(a)]
            self._rate[kind] = sum(rates) / len(rates) if rates else None
        return self._rate[kind]

    def observe(self, op: Op, seconds: float, alpha: float = 0.5) -> None:
        self.record(op.kind, op.agent, seconds, alpha)

    def record(self, kind: str, agent: str, seconds: float, alpha: float = 0.5) -> None:
        """Fold one measurement into `agent`'s moving average for `kind` (a program op's decode
        seconds per agent go in as that agent's rollouts)."""
        per_agent = self.est_s[kind]
        prev = per_agent.get(agent)
        per_agent[agent] = seconds if prev is None else (1 - alpha) * prev + alpha * seconds
        self._rate.pop(kind, None)

    @property
    def hosting(self) -> int:
        """Ops running now that host trajectories (placement `host`: program ops)."""
        return sum(n for kind, n in self.running.items() if traits(kind).placement == "host")

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


def token_sizes(meg: MEG) -> dict[str, dict[str, float]]:
    """Each agent's rollout op (one round) and train op (every round of a micro-batch) in
    tokens per sequence, from its config: `max_new_tokens` generated, a prompt of its
    template's text plus each parent's `max_new_tokens` (the input's length is the same for
    every agent and left out). Prompt tokens weigh `PREFILL_WEIGHT` in a rollout, fully in
    training (one forward and backward over the whole sequence)."""
    rollout: dict[str, float] = {}
    train: dict[str, float] = defaultdict(float)
    for node in meg.nodes:
        a = meg.agents[node.agent]
        prompt = len(a.template or "") + sum(meg.agents[p.agent].sampling.max_new_tokens for p in meg.parents[node])
        gen = a.sampling.max_new_tokens
        rollout[node.agent] = max(rollout.get(node.agent, 0.0), gen + PREFILL_WEIGHT * prompt)
        train[node.agent] += gen + prompt
    return {"rollout": rollout, "train": dict(train)}
