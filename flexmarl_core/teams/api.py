"""The team-shape seam: what differs between kinds of team, chosen once from the config.

A team shape (a graph of templated agents, a program that calls its agents, ...) owns what its
kind does differently: the ops that produce an iteration's samples and rewards, the rows an op
must have committed, how the team answers held-out problems, its SFT demonstrations, and the
order the critic's chain reads. The shared path (plan, training, evaluation, audit, SFT) calls
these methods and never asks which shape it holds.

A new shape is one module with a class registered under a name (`register_shape`), picked by
`team.shape` in the config:

    @register_shape("environment")      # teams/environment.py
    class EnvironmentTeam:
        def __init__(self, cfg: ExperimentConfig) -> None: ...
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from flexmarl_core.algorithms.registry import Registry
from flexmarl_core.meg import MEG
from flexmarl_core.ops import Op

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.runfiles.location import RunLocation
    from flexmarl_core.workloads.api import Problem, Workload
    from storage import Store


class PlanView(Protocol):
    """What a shape reads of the plan it adds an iteration to (`orchestrator/plan.py`)."""

    @property
    def num_mb(self) -> int: ...

    @property
    def dependency_parallel(self) -> bool: ...

    @property
    def serial(self) -> bool: ...

    def gate(self, it: int, agent: str) -> list[Op]:
        """The weight syncs a rollout of `agent` in iteration `it` waits for."""
        ...


class RunView(Protocol):
    """What a shape reads of a run to say which samples exist: its files, its store and the
    inputs of a micro-batch (a worker's context, or the audit's reader)."""

    @property
    def loc(self) -> RunLocation: ...

    @property
    def store(self) -> Store: ...

    def inputs(self, iteration: int, mb: int) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Generation:
    """The ops that produce one iteration's samples and rewards, with what each waits for (in
    an order where dependencies come first), and per micro-batch the ops after which its
    rewards are in the store (what training waits for)."""

    deps: dict[Op, list[Op]]
    rewarded: list[list[Op]]


def hosted_generation(plan: PlanView, it: int, kind: str, agents: Sequence[str]) -> Generation:
    """One `kind` op per micro-batch (without `dependency_parallel`: one for the batch) that may
    call any of `agents` (a program op, an episode op), so each waits for all their gating
    weights; a micro-batch is rewarded once its op is done."""
    gates = list(dict.fromkeys(op for a in agents for op in plan.gate(it, a)))
    ops = [Op(it, kind, mb=j) for j in range(plan.num_mb)] if plan.dependency_parallel else [Op(it, kind)]
    return Generation({o: list(gates) for o in ops}, [[o for o in ops if o.mb in (j, -1)] for j in range(plan.num_mb)])


#: (prompt, target) pairs per agent; a prompt is text, or token ids where the shape renders it
Demonstrations = dict[str, list[tuple[str | list[int], str]]]


class TeamShape(Protocol):
    """One kind of team (see the module docstring). `meg`: the team's agents as graph nodes
    (a program team: one node per agent, no edges)."""

    meg: MEG
    #: GRPO groups are whole trajectories (one reward each), not an agent's k-th calls
    trajectory_groups: bool

    def generation(self, plan: PlanView, it: int) -> Generation:
        """Iteration `it`'s sample-producing ops (with the plan's gates and switches)."""
        ...

    def expected_ids(self, run: RunView, it: int, mbs: Sequence[int], agent: str, *,
                     trained: bool = True) -> set[str]:
        """The sample ids of `agent` that micro-batches `mbs` of iteration `it` committed (or
        must commit), what the audit holds the store to; `trained`: those of them that train
        (not of a trajectory that failed), what a train op reads."""
        ...

    def outputs(self, workload: Workload, engines: Mapping[str, Any], problems: Sequence[Problem],
                *, seed: int, greedy: bool) -> list[dict[str, str]]:
        """Each agent's answer text per problem, one trajectory each on `engines` (held-out
        evaluation)."""
        ...

    def demonstrations(self, workload: Workload, problems: Sequence[Problem], *, seed: int,
                       rng: random.Random, perturb: float) -> Demonstrations:
        """SFT pairs per agent for `problems`: the prompts the team really sends, answered
        from the workload's demonstrations (an upstream answer sometimes a plausible mistake,
        `perturb`)."""
        ...

    def call_order(self) -> dict[tuple[str, int], int]:
        """(agent, turn) -> its position in a trajectory's calls, which a critic's GAE chain
        and `credit: step_discount` follow; a shape without one raises ValueError."""
        ...


SHAPES: Registry[Callable[[ExperimentConfig], TeamShape]] = Registry("team shape", "team.shape")


def register_shape(name: str) -> Callable[[Any], Any]:
    """Class decorator: the shape `team.shape: <name>` selects (a second one is an error)."""
    return SHAPES.register(name)
