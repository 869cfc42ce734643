"""Shared machinery of the built-in workloads: reward mixing and finite problem pools.

`RuleWorkload` fixes how scores become rewards (credit assignment, format terms, custom
reward callables), so every workload, built-in or user-defined, shapes rewards the same way.
`PoolWorkload` turns any finite list of problems (a dataset file, a callable's output) into
deterministic, disjoint train / held-out streams.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from flexmarl_core.workloads.answers import (
    MATCH_MODES,
    MatchMode,
    answer_well_formed,
    answers_match,
)
from flexmarl_core.workloads.api import SPLITS, Problem, Split, WorkloadError

Credit = Literal["team", "per_agent", "step_discount"]


class ScoreFn(Protocol):
    """A reward callable after loading: `(problem, outputs) -> float` in 0..1 (see callables)."""

    def __call__(self, problem: Problem, outputs: Mapping[str, str]) -> float: ...


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise WorkloadError(f"split {split!r} is not one of {list(SPLITS)}")
    return split  # type: ignore[return-value]


def check_count(n: int, offset: int) -> None:
    if n < 0 or offset < 0:
        raise WorkloadError(f"need n >= 0 and offset >= 0, got n={n}, offset={offset}")


def hash_fraction(text: str, salt: str = "flexmarl-split") -> float:
    """A stable pseudo-random number in [0, 1) for `text`.

    Splits are decided by the problem *text* (not its id or position), so the same question
    can never land in both splits, whatever seed or order the pool comes in.
    """
    digest = hashlib.sha256(f"{salt}/{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


_SPLIT_ALIASES: dict[str, Split] = {
    "train": "train",
    "heldout": "heldout",
    "held-out": "heldout",
    "test": "heldout",
    "eval": "heldout",
    "validation": "heldout",
    "val": "heldout",
    "dev": "heldout",
}


def normalize_split(value: Any, *, where: str) -> Split:
    """A split label from data -> 'train' or 'heldout' (test/eval/validation mean held-out)."""
    split = _SPLIT_ALIASES.get(str(value).strip().lower())
    if split is None:
        raise WorkloadError(f"{where}: split {value!r} is not one of {sorted(_SPLIT_ALIASES)}")
    return split


def parse_params(model: Any, params: Mapping[str, Any], kind: str) -> Any:
    """`workload.params` validated by a pydantic `model`; one WorkloadError naming each field."""
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise WorkloadError(f"workload.params for kind={kind}: {msgs}") from None


def assign_roles(configured: Mapping[str, str], agents: list[str], defaults: Mapping[str, str],
                 fallback: str) -> dict[str, Any]:
    """Each agent's role: `workload.params.roles` first, then the team's default by agent name,
    else `fallback`; a configured name that is no agent of the team is an error."""
    unknown = sorted(set(configured) - set(agents))
    if unknown:
        raise WorkloadError(f"workload.params.roles names unknown agent(s) {unknown}; agents: {agents}")
    return {a: configured.get(a, defaults.get(a, fallback)) for a in agents}


class RuleWorkload(ABC):
    """A workload whose reward is a rule over 0..1 scores.

    Subclasses define `team_score` (is the team's answer right), optionally `agent_score`
    (each agent's own contribution, for `credit: per_agent`; default: the team score) and
    `format_score` (default: non-empty output). Custom reward callables from the config
    replace the team score (`workload.reward`) or one agent's own score
    (`workload.agent_rewards`); the mixing rule below stays the same.
    """

    def __init__(
        self,
        agents: list[str],
        output_agent: str,
        *,
        credit: Credit = "team",
        format_weight: float = 0.1,
        team_reward: ScoreFn | None = None,
        agent_rewards: Mapping[str, ScoreFn] | None = None,
    ) -> None:
        if output_agent not in agents:
            raise WorkloadError(f"output agent {output_agent!r} is not one of the agents {agents}")
        if not 0.0 <= format_weight <= 1.0:
            raise WorkloadError(
                f"workload.format_weight={format_weight} must be in [0, 1]: the reward is "
                "(1 - format_weight) * score + format_weight * format"
            )
        if credit not in ("team", "per_agent", "step_discount"):
            raise WorkloadError(f"workload.credit={credit!r} must be 'team', 'per_agent' or 'step_discount'")
        agent_rewards = dict(agent_rewards or {})
        unknown = sorted(set(agent_rewards) - set(agents))
        if unknown:
            raise WorkloadError(
                f"workload.agent_rewards names unknown agent(s) {unknown}; agents: {agents}"
            )
        if agent_rewards and credit != "per_agent":
            raise WorkloadError(
                "workload.agent_rewards only applies with workload.credit: per_agent "
                f"(got credit: {credit}); set credit: per_agent or drop agent_rewards"
            )
        self.agents = list(agents)
        self.output_agent = output_agent
        self.credit: Credit = credit
        self.format_weight = float(format_weight)
        self.team_reward = team_reward
        self.agent_rewards = agent_rewards

    # -- what subclasses define ---------------------------------------------------------------

    @abstractmethod
    def problems(self, split: Split, n: int, seed: int, offset: int = 0) -> list[Problem]: ...

    @abstractmethod
    def team_score(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        """Built-in 0..1 correctness of the team's answer (the output agent's text)."""

    @abstractmethod
    def demonstration(
        self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]
    ) -> str: ...

    @abstractmethod
    def heldout_description(self, n: int) -> str:
        """One line naming the problems that held-out accuracy is measured on when `n` are
        asked for (`workload.heldout_size`): where they come from and how many, for the run
        summary, e.g. '128 of 1319 held-out problems from /data/gsm8k/test.jsonl'."""

    def agent_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float | None:
        """Built-in 0..1 score of `agent`'s own contribution under `credit: per_agent`.

        None (the default) means "the team's score": the team score may be expensive (code
        execution), so `reward` computes it once and reuses it.
        """
        return None

    def format_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float:
        """0..1: does `agent`'s output look like what that agent should write."""
        return 1.0 if outputs.get(agent, "").strip() else 0.0

    def turn_rewards(self, problem: Problem, agent: str, turns: list[str], final: float) -> list[float]:
        """The reward of each of `agent`'s turns (its responses in round order) in one
        trajectory, given `final`, its share of `reward` for the last turn's outputs.

        Default: every turn gets `final`. A workload that can check an earlier turn exactly
        pays that turn for its own work instead (per-turn credit)."""
        return [final] * len(turns)

    # -- the shared rule ----------------------------------------------------------------------

    def _team(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        if self.team_reward is not None:
            return self.team_reward(problem, outputs)
        return self.team_score(problem, outputs)

    def reward(self, problem: Problem, outputs: Mapping[str, str]) -> dict[str, float]:
        outputs = {a: outputs.get(a, "") for a in self.agents}
        team = self._team(problem, outputs)
        w = self.format_weight
        rewards: dict[str, float] = {}
        for agent in self.agents:
            if self.credit in ("team", "step_discount"):  # step_discount: discounted by position
                score = team
            elif agent in self.agent_rewards:
                score = self.agent_rewards[agent](problem, outputs)
            else:
                own = self.agent_score(problem, agent, outputs)
                score = team if own is None else own
            fmt = self.format_score(problem, agent, outputs) if w else 0.0
            rewards[agent] = (1.0 - w) * score + w * fmt
        return rewards

    def is_correct(self, problem: Problem, outputs: Mapping[str, str]) -> bool:
        # Full marks only: with a partial-credit reward callable, 0.9 is not "correct".
        return self._team(problem, {a: outputs.get(a, "") for a in self.agents}) >= 1.0 - 1e-9


class PoolWorkload(RuleWorkload):
    """A workload over a finite list of problems, split into train and held-out.

    A problem whose `meta["split"]` is set stays in that split; the others are assigned by a
    hash of their text (`heldout_fraction` of them go to held-out). A train problem whose text
    is also held-out is dropped (`dropped_from_train`), so the splits never share text.

    Train draws walk a seeded permutation of the train pool, epoch after epoch (each epoch
    reshuffled, input ids suffixed `~{epoch}` so sample ids never repeat); held-out draws
    never repeat, so asking for more than the pool returns the whole pool.

    The pool is loaded lazily and dropped when pickled, so shipping the workload to a Dask
    worker costs bytes, not the dataset; the worker reloads it from the same source.
    """

    def __init__(self, *args: Any, heldout_fraction: float = 0.2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 0.0 <= heldout_fraction < 1.0:
            raise WorkloadError(f"params.heldout_fraction={heldout_fraction} must be in [0, 1)")
        self.heldout_fraction = heldout_fraction
        self._pools: dict[Split, list[Problem]] | None = None
        #: train problems dropped because their text is also held-out (set on load)
        self.dropped_from_train = 0
        #: held-out problems that the hash of their text put there, not a split label (on load)
        self.hashed_heldout = 0

    @abstractmethod
    def load(self) -> list[Problem]:
        """All problems of the source, in a stable order; raises WorkloadError on bad rows."""

    @property
    def source(self) -> str:
        """Where the problems come from, for error messages."""
        return type(self).__name__

    @property
    def heldout_origin(self) -> str:
        """Where the problems pinned to held-out (not hash-split) come from."""
        return f"the problems of {self.source} labelled held-out"

    def heldout_description(self, n: int) -> str:
        held = len(self.pools()["heldout"])
        used = min(n, held)
        noun = "held-out problem" if held == 1 else "held-out problems"
        head = f"{'all ' if held > 1 else ''}{held} {noun}" if used == held else f"{used} of {held} {noun}"
        pinned, hashed = held - self.hashed_heldout, self.hashed_heldout
        split = f"a hash split ({self.heldout_fraction:.0%}) of {self.source}"
        if not hashed:
            out = f"{head} from {self.heldout_origin}"
        elif not pinned:
            out = f"{head}, {split}"
        else:
            out = f"{head}: {pinned} from {self.heldout_origin}, {hashed} from {split}"
        if self.dropped_from_train:
            out += f"; {self.dropped_from_train} train problem(s) repeating one were dropped"
        return out

    def pools(self) -> dict[Split, list[Problem]]:
        if self._pools is None:
            pools: dict[Split, list[Problem]] = {"train": [], "heldout": []}
            seen: dict[str, str] = {}
            hashed = 0
            for i, p in enumerate(self.load()):
                here = str(p.meta.get("where", f"problem {i}"))
                if p.input_id in seen:
                    raise WorkloadError(
                        f"{self.source}: duplicate input id {p.input_id!r} in {seen[p.input_id]} "
                        f"and {here}; ids must be unique"
                    )
                seen[p.input_id] = here
                split = p.meta.get("split")
                if split is None:
                    split = "heldout" if hash_fraction(p.text) < self.heldout_fraction else "train"
                    hashed += split == "heldout"
                else:
                    split = normalize_split(split, where=f"{self.source}: problem {p.input_id!r}")
                pools[split].append(p)
            # A pinned split can repeat a held-out question in train (contaminated data):
            # such copies leave the train pool, so held-out accuracy stays honest.
            held = {p.text for p in pools["heldout"]}
            train = [p for p in pools["train"] if p.text not in held]
            self.dropped_from_train = len(pools["train"]) - len(train)
            self.hashed_heldout = hashed
            pools["train"] = train
            self._pools = pools
        return self._pools

    def problems(self, split: Split, n: int, seed: int, offset: int = 0) -> list[Problem]:
        split = check_split(split)
        check_count(n, offset)
        pool = self.pools()[split]
        if not pool:
            raise WorkloadError(
                f"{self.source}: the {split} split is empty; map a split column "
                "(workload.fields.split) or change params.heldout_fraction"
            )
        size = len(pool)
        out: list[Problem] = []
        stop = offset + n if split == "train" else min(offset + n, size)
        perms: dict[int, list[int]] = {}
        for k in range(offset, stop):
            epoch, pos = divmod(k, size)
            if epoch not in perms:
                perm = list(range(size))
                random.Random(f"{seed}/{split}/{epoch}").shuffle(perm)
                perms[epoch] = perm
            p = pool[perms[epoch][pos]]
            if epoch:
                p = Problem(f"{p.input_id}~{epoch}", p.text, p.answer, p.meta)
            out.append(p)
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pools"] = None
        return state


class AnswerPoolWorkload(PoolWorkload):
    """A pool of question/answer problems scored by answer matching (datasets, callables).

    Team score: the output agent's text matches `problem.answer` (`match`: numeric for a
    number, normalized exact text otherwise; see `answers`). Format: the output agent states
    a number / one line; other agents wrote something. Demonstrations: `meta["demo"][agent]`
    when the source gives one (a dataset's `demo.<agent>` column), else the answer, which keeps
    a demonstration-following team correct.
    """

    def __init__(self, *args: Any, match: MatchMode = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if match not in MATCH_MODES:
            raise WorkloadError(f"params.match={match!r} must be one of {list(MATCH_MODES)}")
        self.match: MatchMode = match

    def team_score(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        text = outputs.get(self.output_agent, "")
        return 1.0 if answers_match(text, problem.answer, self.match) else 0.0

    def format_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float:
        text = outputs.get(agent, "")
        if agent == self.output_agent:
            return 1.0 if answer_well_formed(text, problem.answer, self.match) else 0.0
        return 1.0 if text.strip() else 0.0

    def demonstration(self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]) -> str:
        if agent not in self.agents:
            raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")
        demos = problem.meta.get("demo") or {}
        return str(demos[agent]) if agent in demos else problem.answer


def step_discount(reward: float, position: int, calls: int, gamma: float) -> float:
    """`credit: step_discount`: call `position` of a trajectory's `calls` (in call order) gets
    gamma^(calls-1-position) of its team reward, so the last call gets it whole and earlier
    ones, further from the outcome, less (a discounted return with the reward at the end)."""
    return reward * gamma ** (calls - 1 - position)
