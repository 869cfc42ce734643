"""Environments an environment team plays: one protocol (`api.py`) over OpenSpiel, TextArena,
PettingZoo and a user's own class, plus scripted opponents and Kuhn poker ground truth.

    env = make_environment("openspiel:kuhn_poker")
    ep = env.episode(seed=7)
    while (turn := ep.turn()) is not None:
        step = ep.act(answer_for(turn))
"""

from __future__ import annotations

from flexmarl_core.envs.api import (
           Environment,
           Episode,
           Step,
           Turn,
           bracketed,
           make_environment,
           parse_action,
)
from flexmarl_core.envs.scripted import Policy, scripted_policy

__all__ = ["Environment", "Episode", "Policy", "Step", "Turn", "bracketed", "make_environment", "parse_action",
           "scripted_policy"]
