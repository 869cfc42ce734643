"""Workload contracts: what a problem is and what a workload must answer about it.

A workload is the task side of a run: it hands out problems, scores what a team wrote, and
knows the ideal output of each agent (for the SFT warm start). Everything here is a data type
or a Protocol; implementations live beside this file (`arithmetic.py`, `dataset.py`,
`callables.py`) and `make_workload` in `__init__.py` picks one from the config.

Reward shape, shared by every built-in workload (see `base.RuleWorkload`)::

    reward[agent] = (1 - format_weight) * score[agent] + format_weight * format[agent]

`score` is 0..1 correctness: the team's answer for every agent under `credit: team`, each
agent's own contribution under `credit: per_agent`. `format` is 0..1 (the output parses as
that agent is expected to write it). A demonstration-following team therefore earns exactly
1.0 per agent, and a well-formed wrong answer still earns `format_weight`, which keeps a
GRPO group of all-wrong samples from having zero variance when some are malformed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")


class WorkloadError(ValueError):
    """A workload that cannot be built or used; the message names the file, row or callable."""


@dataclass(frozen=True)
class Problem:
    """One input of the team.

    `input_id` keys every sample of this problem in the MEG (`{input_id}:{traj}:{agent}:{turn}`),
    so it is unique per draw within a seed and never contains ':'. `text` fills `{input}` in
    the templates; `answer` is the reference the reward compares against; `meta` carries
    workload-specific extras (the arithmetic plan, a GSM8K rationale, dataset columns).
    """

    input_id: str
    text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.input_id or ":" in self.input_id:
            raise WorkloadError(
                f"input_id {self.input_id!r} must be non-empty and contain no ':' "
                "(sample ids are '{input_id}:{traj}:{agent}:{turn}')"
            )


@runtime_checkable
class Workload(Protocol):
    """Problems, rewards and demonstrations for one team.

    All methods are pure functions of their arguments and the workload's config, so a
    workload can be pickled to Dask workers and give identical answers there.
    """

    #: agent names of the team, in MEG (topological) order
    agents: list[str]
    #: the agent whose (final-turn) output is the team's answer
    output_agent: str

    def problems(self, split: Split, n: int, seed: int, offset: int = 0) -> list[Problem]:
        """Problems `offset .. offset+n-1` of `split`'s stream for `seed`.

        Deterministic; no problem text appears in both splits. Train streams never run dry
        (finite pools repeat in reshuffled epochs with fresh input ids); a held-out pool
        returns at most its size so that accuracy is not skewed by repeats.
        """
        ...

    def reward(self, problem: Problem, outputs: Mapping[str, str]) -> dict[str, float]:
        """Reward for every team agent, given each agent's final-turn output text.

        A missing agent counts as an empty (malformed) output.
        """
        ...

    def turn_rewards(self, problem: Problem, agent: str, turns: list[str], final: float) -> list[float]:
        """Each of `agent`'s turns' reward (turns in round order); `final` is its `reward`
        share for the last turn's outputs (`RuleWorkload`: every turn gets `final`)."""
        ...

    def is_correct(self, problem: Problem, outputs: Mapping[str, str]) -> bool:
        """Whether the team's answer (the output agent's text) earns full marks."""
        ...

    def demonstration(self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]) -> str:
        """The ideal output of `agent` (no stop string; the SFT code appends EOS).

        Demonstrations aim at a correct *team* answer, so an agent downstream of a wrong
        parent output is shown the right answer, not a faithful copy of the mistake.
        """
        ...


@runtime_checkable
class SupportsToolTurns(Protocol):
    """Optional: an agent that calls tools through a program's endpoint (a ReAct loop) is
    demonstrated turn by turn. `tool_turn` gives its `k`-th turn in a trajectory: a call
    `(function name, arguments)`, or its final answer as text; None: `agent` calls no tool
    (its `demonstration` is used)."""

    def tool_turn(self, problem: Problem, agent: str, k: int) -> tuple[str, dict[str, Any]] | str | None: ...


@runtime_checkable
class SupportsPerturbation(Protocol):
    """Optional: a plausible *wrong* output of an agent, to build SFT examples where a
    downstream agent sees (and learns to fix) a parent's mistake. Without such examples a
    verifier trained only on correct parents learns to copy."""

    def perturbation(self, problem: Problem, agent: str, rng: random.Random) -> str: ...
