"""Retention: which weight versions and trainer states a run keeps, and deleting the rest.

Per agent (and critic), after its step of version d and its sync of version w are in the op
log durably (`MetricsWriter.durable`), a run keeps

- weights: version 0 (the initial weights), versions w-k .. w (k = `codesign.max_staleness`:
  the versions a rollout still to run may sample with; a partial rollout only moves to newer
  ones), the newest full checkpoint's, and every `train.keep_every`-th;
- trainer states: the newest at or below d (where a resume starts or replays from), any above
  d (a step in flight wrote it), and every `train.keep_every`-th;

and deletes every other file under `weights/<agent>/` and `trainers/<agent>/`. Disk then holds
k + 3 weight versions and about two trainer states per agent, at any run length.

What a repair needs (`driver/repair.py`): the samples not yet trained on are written again by
the ops that sampled them, with the weights they sampled with, which this keeps: an agent's
rollouts of an iteration it has not synced used versions w-k .. w. An op that samples with
every agent's weights (a program, an episode) needs each agent's of its iteration, so once
such an op has run, the floor w is the lowest any agent has synced (an agent ahead of the
others keeps its versions back to it). Samples already trained into a kept trainer state are
history: a damaged fragment of them is recorded as lost, and only `keep_every` keeps what
writes them again.

Why the flow process deletes, and only after the op log is durable: the ops a resume runs again
are exactly those its op log does not record. Once a sync of w is recorded, every rollout of
the agent up to iteration w-1 is recorded too (its step waited for them), so nothing a resume
reruns reads a version below w-k. A worker could not know that: on object storage the op log
reaches the store seconds after the ops. A crash between a new version's write and an old
one's delete leaves one version too many, which the next sync's pass deletes (it lists the
folder). Each delete is one file's unlink or DELETE: a reader sees the whole file or none.
This relies on the orchestrator running one op of a trainer at a time (a sync is never
overtaken by its agent's next step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from flexmarl_core.ops import OpRecord, traits
from flexmarl_core.orchestrator.hooks import RunHook
from flexmarl_core.runfiles.location import RunLocation, trainer_key, weights_key

__all__ = ["KeepRule", "Retention"]

log = logging.getLogger(__name__)


class KeepRule:
    """The versions kept of one run's files (see the module docstring)."""

    def __init__(self, max_staleness: int, keep_every: int | None) -> None:
        self.k = max_staleness
        self.every = keep_every

    def _every(self, v: int) -> bool:
        return self.every is not None and v % self.every == 0

    def states(self, have: list[int], stepped: int) -> set[int]:
        """Trainer states kept of `have` once step `stepped` is durable."""
        base = max((v for v in have if v <= stepped), default=None)
        return {v for v in have if v == base or v > stepped or self._every(v)}

    def weights(self, have: list[int], synced: int, states: set[int], floor: int | None = None) -> set[int]:
        """Weight versions kept of `have` once sync `synced` is durable; `states`: the trainer
        states kept (the newest of them at or below `synced` is the newest full checkpoint);
        `floor`: the lowest version any agent has synced, when an op samples with every
        agent's weights (the module docstring)."""
        full = max((v for v in states if v <= synced), default=None)
        low = synced if floor is None else min(synced, floor)
        return {v for v in have if v == 0 or v >= low - self.k or v == full or self._every(v)}


class Retention(RunHook):
    """Deletes what `KeepRule` does not keep, as each agent's steps and syncs become durable in
    the op log (`durable()`: how many op records are; `run.train` passes the writer's)."""

    def __init__(self, rule: KeepRule, loc: RunLocation, durable: Callable[[], int]) -> None:
        self.rule, self.loc, self.durable = rule, loc, durable
        self._seen = 0  # op records passed to this hook
        #: (record number, a step (else a sync), agent, version) not yet durable
        self._pending: list[tuple[int, bool, str, int]] = []
        self._stepped: dict[str, int] = {}
        self._synced: dict[str, int] = {}
        #: an op sampled with every agent's weights: versions are kept back to the lowest synced
        self._shared = False
        #: agents whose steps or syncs an earlier attempt recorded (`restore`)
        self._restored: set[str] = set()

    def restore(self, records: Iterable[OpRecord]) -> None:
        """An earlier attempt's records (`--resume`): their steps and syncs are durable, and what
        the rule drops for them is dropped once this attempt ends, even for an agent with no op
        left to run (the earlier attempt may have died between recording a sync and deleting)."""
        for record in records:
            kind = traits(record.op.kind)
            self._shared = self._shared or (kind.generates and kind.samples == "all")
            if kind.steps or kind.publishes:
                seen = self._stepped if kind.steps else self._synced
                seen[record.op.agent] = max(seen.get(record.op.agent, 0), record.op.iteration + 1)
                self._restored.add(record.op.agent)

    def op_done(self, record: OpRecord, **kwargs: Any) -> None:
        self._seen += 1
        op = record.op
        kind = traits(op.kind)
        self._shared = self._shared or (kind.generates and kind.samples == "all")
        if kind.steps or kind.publishes:
            self._pending.append((self._seen, kind.steps, op.agent, op.iteration + 1))
        self.release()

    def release(self, *, everything: bool = False) -> None:
        """Apply the rule for the agents whose records are durable now (`everything`: the op
        log is closed, all are)."""
        if not self._pending and not (everything and self._restored):
            return
        upto = self._seen if everything else self.durable()
        changed: set[str] = set(self._restored) if everything else set()
        floor = min(self._synced.values(), default=0)
        while self._pending and self._pending[0][0] <= upto:
            _, stepped, agent, version = self._pending.pop(0)
            seen = self._stepped if stepped else self._synced
            seen[agent] = max(seen.get(agent, 0), version)
            changed.add(agent)
        if self._shared and min(self._synced.values(), default=0) != floor:
            changed |= set(self._synced)  # the floor rose: what agents ahead kept for it may go
        for agent in sorted(changed):
            try:
                self._apply(agent)
            except OSError as exc:  # the next pass lists the folder again: nothing is lost
                log.warning("retention: deleting %s's old versions failed (%s); the next sync retries", agent, exc)

    def _apply(self, agent: str) -> None:
        states = self.loc.versions(f"trainers/{agent}")
        keep_states = self.rule.states(states, self._stepped.get(agent, 0)) if agent in self._stepped else set(states)
        for v in states:
            if v not in keep_states:
                self.loc.delete(trainer_key(agent, v))
        if agent in self._synced:
            have = self.loc.versions(f"weights/{agent}")
            floor = min(self._synced.values()) if self._shared else None
            for v in sorted(set(have) - self.rule.weights(have, self._synced[agent], keep_states, floor)):
                self.loc.delete(weights_key(agent, v))
