"""Estimator scopes: what an advantage estimator needs of a run, in one object per scope.

An estimator registers with a scope (`register_advantage(name, scope=...)`); the scope says
both halves of what that means:

- `waits`: what an agent's train op of micro-batch j waits for in the plan (`orchestrator/
  plan.py` adds it to the op's dependencies);
- `read`: which rows that train op reads from the store and where their advantages come from
  (`trainers/policy.py` `micro_batch` calls it, and never asks for a scope by name).

    group   an input's group is within the micro-batch: its rewards are enough
    batch   normalised over the iteration (REINFORCE++): every reward of the iteration
    critic  GAE along the micro-batch's calls: the critics' values of the micro-batch
    role    a return less its role's baseline (RAE): the micro-batch and earlier iterations

A new scope is one class here, registered with `@register_scope("<name>")`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from flexmarl_core.algorithms import compute_advantages
from flexmarl_core.algorithms.registry import Registry
from flexmarl_core.ops import Op
from flexmarl_core.trainers.critic import targets

if TYPE_CHECKING:
    from flexmarl_core.runtime.view import WorkerView

Row = dict[str, Any]


class ScopePlan(Protocol):
    """What a scope reads of the plan it adds a train op's dependencies to."""

    @property
    def critics(self) -> list[str]: ...


@dataclass(frozen=True)
class ScopeRead:
    """What a train op reads: `rows` (before the shape's expected ids filter them), the
    micro-batches they cover, and how the kept rows get their advantages (one per row, and
    per token where the scope has them)."""

    rows: list[Row]
    mbs: list[int]
    advantages: Callable[[list[Row]], tuple[list[float], list[list[float] | None]]]


class EstimatorScope(Protocol):
    def waits(self, plan: ScopePlan, it: int, mb: int, mine: list[Op], every: list[Op]) -> list[Op]:
        """The ops a train op of micro-batch `mb` waits for: `mine` are the micro-batch's
        rewarding ops (off the async pipeline: every one), `every` the iteration's."""
        ...

    def read(self, ctx: WorkerView, agent: str, estimator: str, it: int, mb: int) -> ScopeRead: ...


SCOPES: Registry[Any] = Registry("estimator scope", "register_advantage(scope=...)")


def register_scope(name: str) -> Callable[[type], type]:
    """Class decorator: the scope `name` (an instance of the class serves every agent)."""
    def deco(cls: type) -> type:
        SCOPES.register(name)(cls())
        return cls
    return deco


def estimator_scope(name: str) -> EstimatorScope:
    """The scope registered as `name` (an unknown one lists the valid ones)."""
    return SCOPES.get(name)


def advantages(estimator: str, rows: Sequence[Row], per_trajectory: bool = False) -> list[float]:
    """Each row's advantage. Groups are an input's samples of one turn (a YAML team's round, a
    program's k-th call of the agent: AT-GRPO's agent-and-turn groups). `per_trajectory` (a
    program team's `program_groups: trajectory`): one reward per trajectory (its first sample's),
    normalised over the input's trajectories, and every sample of it gets that advantage."""
    if not per_trajectory:
        return compute_advantages(estimator, [float(r["reward"]) for r in rows],
                                  [f"{r['input_id']}:{r['turn']}" for r in rows]).tolist()
    trajs: dict[tuple[str, int], float] = {}
    for r in sorted(rows, key=lambda r: r["turn"]):
        trajs.setdefault((r["input_id"], r["traj"]), float(r["reward"]))
    keys = sorted(trajs)
    adv = compute_advantages(estimator, [trajs[k] for k in keys], [k[0] for k in keys]).tolist()
    of = dict(zip(keys, adv, strict=True))
    return [of[(r["input_id"], r["traj"])] for r in rows]


def _rewarded(ctx: WorkerView, agent: str, it: int, mb: int | None) -> list[Row]:
    # Consumed-or-not does not matter here: the trainer is still at `it`, so no update has
    # applied these samples yet; a `consumed_step` on them was written by an attempt whose
    # gradients died with its process (the version check keeps this exactly-once).
    return ctx.store.ready(agent, it, need=("reward",), unconsumed=False, mb=mb).to_pylist()


def _from_rewards(ctx: WorkerView, estimator: str) -> Callable[[list[Row]], tuple[list[float], list[None]]]:
    def adv(rows: list[Row]) -> tuple[list[float], list[None]]:
        return advantages(estimator, rows, ctx.team.trajectory_groups), [None] * len(rows)
    return adv


@register_scope("group")
class GroupScope:
    """The micro-batch holds whole groups: its rewards are enough."""

    def waits(self, plan: ScopePlan, it: int, mb: int, mine: list[Op], every: list[Op]) -> list[Op]:
        return list(mine)

    def read(self, ctx: WorkerView, agent: str, estimator: str, it: int, mb: int) -> ScopeRead:
        return ScopeRead(_rewarded(ctx, agent, it, mb), [mb], _from_rewards(ctx, estimator))


@register_scope("batch")
class BatchScope:
    """Normalised over the iteration: every reward of it, the whole batch's rows read (the op
    trains only its own micro-batch's)."""

    def waits(self, plan: ScopePlan, it: int, mb: int, mine: list[Op], every: list[Op]) -> list[Op]:
        return list(every)

    def read(self, ctx: WorkerView, agent: str, estimator: str, it: int, mb: int) -> ScopeRead:
        return ScopeRead(_rewarded(ctx, agent, it, None), list(range(ctx.cfg.batch.num_micro_batches)),
                         _from_rewards(ctx, estimator))


@register_scope("critic")
class CriticScope:
    """GAE along the micro-batch's calls: the critics' values of this micro-batch only, no
    barrier on the batch; the critics' rows hold this agent's targets."""

    def waits(self, plan: ScopePlan, it: int, mb: int, mine: list[Op], every: list[Op]) -> list[Op]:
        return [*mine, *(Op(it, "value", c, mb=mb) for c in plan.critics)]

    def read(self, ctx: WorkerView, agent: str, estimator: str, it: int, mb: int) -> ScopeRead:
        chain, tg = targets(ctx, it, mb)
        per_token = ctx.cfg.critic.per_token

        def adv(rows: list[Row]) -> tuple[list[float], list[list[float] | None]]:
            return ([tg[r["sample_id"]].advantages[0] for r in rows],
                    [tg[r["sample_id"]].advantages if per_token else None for r in rows])
        return ScopeRead([r for r in chain if r["agent"] == agent], [mb], adv)


#: RAE's baseline: b <- ROLE_EMA * b + (1 - ROLE_EMA) * (the role's mean return of an iteration)
ROLE_EMA = 0.95
#: (store, agent, iteration) -> each role's mean return then (a finished iteration's do not change)
_ROLE_MEANS: dict[tuple[str, str, int], dict[str, float]] = {}


def role_of(row: Row) -> str:
    """An answer's role: its seat (an environment team's rows say it), else its turn."""
    extra = json.loads(row.get("extra") or "{}")
    return str(extra.get("seat", f"turn {row['turn']}"))


def role_baselines(ctx: WorkerView, agent: str, it: int) -> dict[str, float]:
    """Each role's baseline for iteration `it`: the moving average of its mean return over
    iterations 0 .. it-1 (0 before any)."""
    base: dict[str, float] = {}
    for j in range(it):
        key = (ctx.store.uri, agent, j)
        if key not in _ROLE_MEANS:
            by: dict[str, list[float]] = {}
            for r in ctx.store.read_samples(agent, j, columns=["turn", "reward", "extra"]).to_pylist():
                if r["reward"] is not None:
                    by.setdefault(role_of(r), []).append(float(r["reward"]))
            _ROLE_MEANS[key] = {k: sum(v) / len(v) for k, v in by.items()}
        for role, mean in _ROLE_MEANS[key].items():
            base[role] = ROLE_EMA * base.get(role, 0.0) + (1 - ROLE_EMA) * mean
    return base


@register_scope("role")
class RoleScope:
    """RAE (SPIRAL): each answer's advantage is its return less its role's baseline, so a
    zero-sum game's seats are not measured against each other; no barrier on the batch."""

    def waits(self, plan: ScopePlan, it: int, mb: int, mine: list[Op], every: list[Op]) -> list[Op]:
        return list(mine)

    def read(self, ctx: WorkerView, agent: str, estimator: str, it: int, mb: int) -> ScopeRead:
        base = role_baselines(ctx, agent, it)

        def adv(rows: list[Row]) -> tuple[list[float], list[None]]:
            vals = [float(r["reward"]) - base.get(role_of(r), 0.0) for r in rows]
            return compute_advantages(estimator, vals, [role_of(r) for r in rows]).tolist(), [None] * len(rows)
        return ScopeRead(_rewarded(ctx, agent, it, mb), [mb], adv)
