"""The iteration task graph: every op of a run and the ops it waits for, derived from the MEG
and the co-design switches. Per iteration `it` and micro-batch `mb` (whole GRPO groups):

    rollout(agent@turn, it, mb) ─► ... ─► reward(it, mb) ─► train(agent, it, mb) ─► step(agent, it) ─► sync(agent, it)
                 ▲                                                                                       │
                 └──────────────────────── rollout(agent@*, it+1, *) waits for it ◄──────────────────────┘

`dependency_parallel` and `async_pipeline` change dependencies only, never the work itself;
`max_staleness` also changes the work: a rollout may sample with an older weights version.

- `dependency_parallel`: a rollout waits for its parents' *same micro-batch*; off: for the
  parents' whole batch (and rewards wait for every rollout of the iteration).
- `async_pipeline`: training of a micro-batch waits only for its rewards and an agent's next
  iteration only for its own weight sync (plus its parents); off: training waits for the whole
  rollout phase and iteration it+1 waits for every agent's sync of it (the synchronous baseline).
- the estimator's scope (`trainers/scopes.py`) says what a train op waits for: a batch-scoped
  estimator (`reinforce_pp`) normalises over the iteration, so its train ops wait for every
  reward of the iteration whatever the pipeline; a group-scoped one needs its micro-batch's.
- critics (agents with `algorithm.advantage: gae`, `config/critic.py`): `value(c, it, mb)` after the
  micro-batch's reward, `train(c, it, mb)`, `step(c, it)`, `sync(c, it)`; an agent's train op
  of a micro-batch also waits for the critics' values of that micro-batch.
- `serial` (a baseline, with the two above off): one agent at a time. A turn's rollouts wait
  for every rollout of the turn before it in topological order (not only for their parents), and
  each agent's (then each critic's) train ops wait for the sync of the one trained before it,
  as a loop over a single-agent trainer runs a team.
- `max_staleness` k > 0 (bounded staleness): iteration it's rollouts wait for the syncs of
  iteration it-1-k instead of it-1 (weights version >= it-k exist), so rollouts run up to k
  iterations ahead of training; a train op then waits for its agent's previous step itself
  (before, the rollout's wait on that sync implied it).

An op waits only for ops of its own iteration and the `reach` (1 + k) before it, so a run's
plan need not exist whole: `Plan.build(cfg, window=n)` holds n iterations, the orchestrator
`extend`s it as the run goes and `forget`s iterations that are done (flat memory over a run of
any length). Without a window the plan is whole, as analysis and the simulator read it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from flexmarl_core.algorithms import Scope, advantage_scope
from flexmarl_core.config import ExperimentConfig
from flexmarl_core.config.critic import critic_names
from flexmarl_core.meg import MEG
from flexmarl_core.ops import Op, OpKind
from flexmarl_core.teams import TeamShape, team_shape
from flexmarl_core.trainers.scopes import estimator_scope


@dataclass
class Plan:
    """All ops of a run and their dependencies, derived from the team's shape and the switches."""

    team: TeamShape
    iterations: int
    num_mb: int
    dependency_parallel: bool
    async_pipeline: bool
    max_staleness: int = 0
    serial: bool = False
    #: critic -> the agents it values (`config.critic.critic_names`); empty without gae
    critics: dict[str, list[str]] = field(default_factory=dict)
    #: trainable agent -> its advantage estimator's scope
    scopes: dict[str, Scope] = field(default_factory=dict)
    #: the iterations built so far and not forgotten, in topological order
    deps: dict[Op, list[Op]] = field(default_factory=dict)
    #: iterations [0, built) were added; [0, floor) were forgotten
    built: int = 0
    floor: int = 0
    #: iterations held ahead when built with a window (None: the whole plan)
    window: int | None = None
    #: ops per iteration (`sizes`)
    _sizes: dict[int, int] = field(default_factory=dict, repr=False)
    #: iteration -> its ops, in topological order
    _by_it: dict[int, list[Op]] = field(default_factory=dict, repr=False)
    #: the last iteration made afresh for `deps_of`, and its ops
    _made: tuple[int, dict[Op, list[Op]]] = (-1, {})

    @classmethod
    def build(cls, cfg: ExperimentConfig, team: TeamShape | None = None, *, window: int | None = None) -> Plan:
        """The run's plan: whole, or its first `window` iterations (`extend` adds the rest)."""
        team = team or team_shape(cfg)
        plan = cls(
            team=team,
            iterations=cfg.train.iterations,
            num_mb=cfg.batch.num_micro_batches,
            dependency_parallel=cfg.codesign.dependency_parallel,
            async_pipeline=cfg.codesign.async_pipeline,
            max_staleness=cfg.codesign.max_staleness,
            serial=cfg.codesign.serial,
            critics=critic_names(cfg),
            scopes={a: advantage_scope(cfg.agent(a).algorithm.advantage) for a in team.meg.trainable_agents},
            window=window,
        )
        n = cfg.train.iterations
        plan.built = n if window is None else min(max(window, 2), n)
        for it in range(plan.built):
            plan._add_iteration(it)
            plan._sizes[it] = len(plan._by_it[it])
        # An iteration's ops are the same from iteration 1 on (only what they wait for
        # differs); `extend` checks it of each iteration it makes.
        for it in range(plan.built, n):
            plan._sizes[it] = plan._sizes[plan.built - 1]
        return plan

    @property
    def reach(self) -> int:
        """How many iterations back an op's dependencies go: 1 + `max_staleness`."""
        return 1 + self.max_staleness

    def extend(self, through: int) -> list[Op]:
        """Add the iterations up to `through` (inclusive, within the run) not built yet; their
        ops, in topological order."""
        new: list[Op] = []
        while self.built <= min(through, self.iterations - 1):
            it = self.built
            self._add_iteration(it)
            if len(self._by_it[it]) != self._sizes[it]:
                raise ValueError(
                    f"team shape {type(self.team).__name__}: iteration {it} has {len(self._by_it[it])} ops, "
                    f"iteration 1 has {self._sizes[it]}; a shape's iterations must have the same ops")
            new += self._by_it[it]
            self.built += 1
        return new

    def forget(self, below: int) -> None:
        """Drop the iterations before `below`, whose ops are all done (the deps of an op still
        to come name them, and are kept with it)."""
        for it in range(self.floor, below):
            for op in self._by_it.pop(it, ()):
                del self.deps[op]
        self.floor = max(self.floor, below)

    def iteration_ops(self, it: int) -> list[Op]:
        """Iteration `it`'s ops in topological order (built and not forgotten; else none)."""
        return self._by_it.get(it, [])

    def iteration_deps(self, it: int) -> dict[Op, list[Op]]:
        """Iteration `it`'s ops and dependencies, made afresh (the plan itself is unchanged)."""
        scratch = replace(self, deps={}, _by_it={}, _made=(-1, {}))
        scratch._add_iteration(it)
        return scratch.deps

    def deps_of(self, op: Op) -> list[Op]:
        """`op`'s dependencies, whether the plan holds its iteration now or not (then made
        afresh; the last such iteration is kept, as an op log comes about in order)."""
        if op in self.deps:
            return self.deps[op]
        if self._made[0] != op.iteration:
            self._made = (op.iteration, self.iteration_deps(op.iteration))
        return self._made[1].get(op, [])

    @property
    def meg(self) -> MEG:
        return self.team.meg

    def gate(self, it: int, agent: str) -> list[Op]:
        """The syncs a rollout of `agent` in iteration `it` waits for: with `async_pipeline`
        its own of iteration it-1-k (k = `max_staleness`), else every trainer's (the critics'
        of it-1 too)."""
        g = it - 1 - self.max_staleness
        trainable = self.meg.trainable_agents
        if self.async_pipeline:
            return [Op(g, "sync", agent)] if g >= 0 and agent in trainable else []
        every = [Op(g, "sync", a) for a in trainable] if g >= 0 else []
        return every + ([Op(it - 1, "sync", c) for c in self.critics] if it > 0 else [])

    def _add_iteration(self, it: int) -> None:
        n = len(self.deps)
        self._add_ops(it)
        self._by_it[it] = list(itertools.islice(reversed(self.deps), len(self.deps) - n))[::-1]

    def _add_ops(self, it: int) -> None:
        gen = self.team.generation(self, it)
        self.deps.update(gen.deps)
        rewarded = gen.rewarded
        every = list(dict.fromkeys(op for ops in rewarded for op in ops))
        for a in self.meg.trainable_agents:
            scope = estimator_scope(self.scopes[a])
            for j in range(self.num_mb):
                d = scope.waits(self, it, j, rewarded[j] if self.async_pipeline else every, every)
                if self.max_staleness and it > 0:  # the trainer must be at version it
                    d.append(Op(it - 1, "step", a))
                self.deps[Op(it, "train", a, mb=j)] = d
            self.deps[Op(it, "step", a)] = [Op(it, "train", a, mb=j) for j in range(self.num_mb)]
            self.deps[Op(it, "sync", a)] = [Op(it, "step", a)]
        self._add_critics(it, rewarded, every)
        if self.serial:  # each agent's (then each critic's) training after the one before it
            order = [*self.meg.trainable_agents, *self.critics]
            for prev, agent in zip(order, order[1:], strict=False):
                for j in range(self.num_mb):
                    self.deps[Op(it, "train", agent, mb=j)].append(Op(it, "sync", prev))

    def _add_critics(self, it: int, rewarded: list[list[Op]], every: list[Op]) -> None:
        """Each critic values a micro-batch once its rewards are in, with its weights of
        iteration `it` (its previous sync), then trains on it once every critic valued it (the
        GAE chain reads them all); step and sync close its iteration as an agent's do."""
        for c in self.critics:
            for j in range(self.num_mb):
                d = list(rewarded[j]) if self.async_pipeline else list(every)
                self.deps[Op(it, "value", c, mb=j)] = d + ([Op(it - 1, "sync", c)] if it > 0 else [])
                self.deps[Op(it, "train", c, mb=j)] = [Op(it, "value", c2, mb=j) for c2 in self.critics]
            self.deps[Op(it, "step", c)] = [Op(it, "train", c, mb=j) for j in range(self.num_mb)]
            self.deps[Op(it, "sync", c)] = [Op(it, "step", c)]

    def sizes(self) -> dict[int, int]:
        """Ops per iteration, of the whole run."""
        return dict(self._sizes)

    def ops(self) -> list[Op]:
        """The ops held now (a whole plan: every op of the run)."""
        return list(self.deps)

    def count(self, kind: OpKind) -> int:
        return sum(1 for op in self.deps if op.kind == kind)
