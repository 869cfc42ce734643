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
- critics (agents with `algorithm.advantage: gae`, `critic.py`): `value(c, it, mb)` after the
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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.critic import critic_names
from flexmarl_core.meg import MEG
from flexmarl_core.ops import Op, OpKind


@dataclass
class Plan:
    """All ops of a run and their dependencies, derived from the MEG and the switches."""

    meg: MEG
    iterations: int
    num_mb: int
    dependency_parallel: bool
    async_pipeline: bool
    max_staleness: int = 0
    serial: bool = False
    #: critic -> the agents it values (`critic.critic_names`); empty without gae
    critics: dict[str, list[str]] = field(default_factory=dict)
    deps: dict[Op, list[Op]] = field(default_factory=dict)

    @classmethod
    def build(cls, cfg: ExperimentConfig, meg: MEG) -> Plan:
        plan = cls(
            meg=meg,
            iterations=cfg.train.iterations,
            num_mb=cfg.batch.num_micro_batches,
            dependency_parallel=cfg.codesign.dependency_parallel,
            async_pipeline=cfg.codesign.async_pipeline,
            max_staleness=cfg.codesign.max_staleness,
            serial=cfg.codesign.serial,
            critics=critic_names(cfg),
        )
        for it in range(cfg.train.iterations):
            plan._add_iteration(it)
            if plan.serial:
                plan._serialise(it)
        return plan

    def _serialise(self, it: int) -> None:
        """`serial`: iteration `it`'s turns, then its trainers, one at a time (see the module doc)."""
        if self.meg.program is None:
            nodes = self.meg.nodes
            for prev, node in zip(nodes, nodes[1:], strict=False):
                before = [Op(it, "rollout", prev.agent, prev.turn, j) for j in range(self.num_mb)]
                for j in range(self.num_mb):
                    d = self.deps[Op(it, "rollout", node.agent, node.turn, j)]
                    d += [b for b in before if b not in d]
        order = [*self.meg.trainable_agents, *self.critics]
        for prev, agent in zip(order, order[1:], strict=False):
            for j in range(self.num_mb):
                self.deps[Op(it, "train", agent, mb=j)].append(Op(it, "sync", prev))

    def _add_iteration(self, it: int) -> None:
        if self.meg.program is not None:
            return self._add_program_iteration(it)
        meg, mbs = self.meg, range(self.num_mb)
        trainable = meg.trainable_agents
        rollouts = {(n.agent, n.turn, j): Op(it, "rollout", n.agent, n.turn, j) for n in meg.nodes for j in mbs}
        gate = it - 1 - self.max_staleness  # the iteration whose syncs gate these rollouts
        prev_syncs = [Op(gate, "sync", a) for a in trainable] if gate >= 0 else []
        if not self.async_pipeline and it > 0:  # the synchronous baseline: the critics' too
            prev_syncs += [Op(it - 1, "sync", c) for c in self.critics]
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
                if self.max_staleness and it > 0:  # the trainer must be at version it
                    self.deps[Op(it, "train", a, mb=j)].append(Op(it - 1, "step", a))
                # GAE: the critics' values of this micro-batch only, no barrier on the batch
                self.deps[Op(it, "train", a, mb=j)] += [Op(it, "value", c, mb=j) for c in self.critics]
            self.deps[Op(it, "step", a)] = [Op(it, "train", a, mb=j) for j in mbs]
            self.deps[Op(it, "sync", a)] = [Op(it, "step", a)]
        self._add_critics(it, rewards)

    def _add_critics(self, it: int, rewards: list[Op]) -> None:
        """Each critic values a micro-batch once its rewards are in, with its weights of
        iteration `it` (its previous sync), then trains on it once every critic valued it (the
        GAE chain reads them all); step and sync close its iteration as an agent's do."""
        for c in self.critics:
            for j in range(self.num_mb):
                d = [rewards[j]] if self.async_pipeline else list(rewards)
                self.deps[Op(it, "value", c, mb=j)] = d + ([Op(it - 1, "sync", c)] if it > 0 else [])
                self.deps[Op(it, "train", c, mb=j)] = [Op(it, "value", c2, mb=j) for c2 in self.critics]
            self.deps[Op(it, "step", c)] = [Op(it, "train", c, mb=j) for j in range(self.num_mb)]
            self.deps[Op(it, "sync", c)] = [Op(it, "step", c)]

    def _add_program_iteration(self, it: int) -> None:
        """A program team: `program(it, mb)` runs the micro-batch's trajectories, calling any agent
        (its calls are the rollouts, its answers are scored in it), so it waits for every
        trainable agent's weights of the gating iteration. Without `dependency_parallel` one
        `program(it)` runs the whole batch, as the synchronous baseline rolls out everything
        before anything trains."""
        trainable = self.meg.trainable_agents
        gate = it - 1 - self.max_staleness
        syncs = [Op(gate, "sync", a) for a in trainable] if gate >= 0 else []
        progs = [Op(it, "program", mb=j) for j in range(self.num_mb)] if self.dependency_parallel \
            else [Op(it, "program")]
        for p in progs:
            self.deps[p] = list(syncs)
        for a in trainable:
            for j in range(self.num_mb):
                mine = [p for p in progs if p.mb in (j, -1)]
                self.deps[Op(it, "train", a, mb=j)] = mine if self.async_pipeline else list(progs)
                if self.max_staleness and it > 0:
                    self.deps[Op(it, "train", a, mb=j)].append(Op(it - 1, "step", a))
            self.deps[Op(it, "step", a)] = [Op(it, "train", a, mb=j) for j in range(self.num_mb)]
            self.deps[Op(it, "sync", a)] = [Op(it, "step", a)]

    def sizes(self) -> dict[int, int]:
        """Ops per iteration."""
        out: dict[int, int] = {}
        for op in self.deps:
            out[op.iteration] = out.get(op.iteration, 0) + 1
        return out

    def ops(self) -> list[Op]:
        return list(self.deps)

    def count(self, kind: OpKind) -> int:
        return sum(1 for op in self.deps if op.kind == kind)
