"""Scripted opponents: the seats of an environment team that are not a model.

A learning seat needs something fixed to play against and to be measured against (uniform
random, always-first, the Kuhn Nash strategy, or a user's function). A policy sees the same
`Turn` the model sees and answers text the same way (`[action]`), so it goes through the same
parsing as a model's answer. Free-text environments (TextArena) list no legal actions; there a
policy picks among the actions the observation's last list of them names (TextArena's
"Your available actions are: '[check]', '[bet]'"; see `choices`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from flexmarl_core.config import ConfigError
from flexmarl_core.envs.api import Turn, load_callable

Policy = Callable[[Turn, random.Random], str]
_NAMES = "random, first, python:<module>:<fn>, openspiel:uniform_random or openspiel:kuhn_nash"


def scripted_policy(name: str, options: Mapping[str, Any] | None = None) -> Policy:
    """The policy `name` names. `python:<module>:<fn>`: `fn(turn, rng) -> str` itself, or with
    `options`, `fn(**options)` must return one. `openspiel:kuhn_nash` takes `alpha` (0..1/3)."""
    opts = dict(options or {})
    if name in ("random", "openspiel:uniform_random"):
        return random_policy
    if name == "first":
        return first_policy
    if name == "openspiel:kuhn_nash":
        from flexmarl_core.envs.kuhn import nash_probs

        return sampling_policy(nash_probs(float(opts.get("alpha", 0.0))))
    if name.startswith("python:"):
        fn = load_callable(f"scripted policy {name!r}", name.removeprefix("python:"), "function")
        return fn(**opts) if opts else fn
    raise ConfigError(f"scripted policy {name!r}: unknown; use {_NAMES}")


def choices(turn: Turn) -> tuple[str, ...]:
    """The actions a policy may pick: the env's legal actions, or for free text the quoted
    bracketed ones ('[x]') on the last line listing any, else the bracketed ones on the last line
    that has any and reports no invalid move."""
    if turn.legal:
        return turn.legal
    lines = turn.observation.splitlines()[::-1]
    for pattern, skip_invalid in ((r"'\[([^\[\]\n]{1,100})\]'", False), (r"\[([^\[\]\n]{1,100})\]", True)):
        for line in lines:
            found = [] if skip_invalid and "invalid" in line.lower() else re.findall(pattern, line)
            if found:
                return tuple(dict.fromkeys(found))
    raise ValueError(f"no actions to choose from for {turn.seat}: the environment lists none "
                     "and the observation names none in brackets")


def random_policy(turn: Turn, rng: random.Random) -> str:
    return f"[{rng.choice(choices(turn))}]"


def first_policy(turn: Turn, rng: random.Random) -> str:
    return f"[{choices(turn)[0]}]"


def sampling_policy(probs: Callable[[str, str, tuple[str, ...]], Any]) -> Policy:
    """A policy that samples from `probs(seat, observation, legal)` (kuhn.py's form)."""

    def policy(turn: Turn, rng: random.Random) -> str:
        weights = list(probs(turn.seat, turn.observation, turn.legal))
        return f"[{rng.choices(turn.legal, weights=weights)[0]}]"

    return policy
