"""The program team: a Python function that calls its agents through flexmarl's
OpenAI-compatible endpoint (`programs/`). One `program` op per micro-batch (without
`dependency_parallel`: one for the batch) runs the trajectories; each call becomes a sample of
the agent it named, the trajectory's answer is scored in the same op, and a manifest lists the
sample ids the op committed (`programs/manifest.py`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flexmarl_core.meg import MEG
from flexmarl_core.programs.manifest import committed_ids
from flexmarl_core.programs.team import ProgramTeam, program_team
from flexmarl_core.teams.api import (
    Demonstrations,
    Generation,
    PlanView,
    RunView,
    hosted_generation,
    register_shape,
)

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.workloads.api import Problem, Workload


@register_shape("program")
class ProgramShape:
    """A team declared as `team.program` (docs/programs.md)."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.meg = MEG.from_config(cfg.team)
        self.trajectory_groups = cfg.team.program_groups == "trajectory"

    @property
    def program(self) -> ProgramTeam:
        """The loaded program and the endpoint's view of the agents (once per process; the
        plan never needs it)."""
        return program_team(self.cfg.team, self.cfg.seed)

    def generation(self, plan: PlanView, it: int) -> Generation:
        """A program op may call any agent, so it waits for every agent's gating weights."""
        return hosted_generation(plan, it, "program", self.meg.agent_names)

    def expected_ids(self, run: RunView, it: int, mbs: Sequence[int], agent: str, *,
                     trained: bool = True) -> set[str]:
        """A program's calls vary: exactly what its ops' manifests list (a failed trajectory
        committed nothing)."""
        return committed_ids(run.loc, it, mbs, agent)

    def outputs(self, workload: Workload, engines: Mapping[str, Any], problems: Sequence[Problem],
                *, seed: int, greedy: bool) -> list[dict[str, str]]:
        """The program on `engines`, greedy, one trajectory per problem (its calls are seeded
        by their identity, not by `seed`)."""
        return self.program.evaluate(engines, problems)

    def demonstrations(self, workload: Workload, problems: Sequence[Problem], *, seed: int,
                       rng: random.Random, perturb: float) -> Demonstrations:
        """The program's own prompts, answered from the workload's demonstrations."""
        return dict(self.program.demonstrations(workload, problems, seed, perturb))

    def call_order(self) -> dict[tuple[str, int], int]:
        raise ValueError("a program team's calls are not ordered across agents in the store; "
                         "use algorithm.advantage grpo and workload.credit team or per_agent")
