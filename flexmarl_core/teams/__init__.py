"""Team shapes (`api.py`): a graph of templated agents (`graph.py`), a program that calls its
agents (`program.py`), or a team that plays an environment (`environment.py`), picked once by
`team.shape`.

    team = team_shape(cfg)        # the run's shape, built from its config
    team.generation(plan, it)     # what the shared path calls; it never asks which shape
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_core.teams import environment, graph, program  # noqa: F401  (registers the shapes)
from flexmarl_core.teams.api import SHAPES, Generation, RunView, TeamShape, register_shape

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig

__all__ = ["SHAPES", "Generation", "RunView", "TeamShape", "register_shape", "team_shape"]


def team_shape(cfg: ExperimentConfig) -> TeamShape:
    """The shape `cfg.team.shape` names, for this config (an unknown name lists the valid ones)."""
    return SHAPES.get(cfg.team.shape)(cfg)
