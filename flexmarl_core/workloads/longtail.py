"""Long-tail reasoning: running sums whose written working grows with the problem's length.

A problem is a chain of one-digit terms such as ``7+3+5-2+8``; the running total stays in
0..`max_total` at every step. The team (planner -> solver -> verifier, see
``configs/longtail_team.yaml``):

* **planner** ("plan" role) writes the first step: ``7+3=10``.
* **solver** ("work" role, the long writer) reads the problem and the plan and writes its
  working, one step per remaining term, then the answer: ``+5=15;-2=13;+8=21;A=21``. A
  two-term problem has no steps left: ``A=10``.
* **verifier** ("answer" role, the team output) reads the problem and the solver's working
  and writes the final answer: ``21``.

Why this shape: the working costs 6 tokens per step (digits are single tokens), so the
solver's sampled length is ``6 * (terms - 2) + 4`` tokens and follows the difficulty. Terms
are drawn from a power law (P(steps = s) proportional to (s + 1) ** -`tail_exponent`, s = 0 ..
`max_steps`): most problems are a few steps, a few run to `max_steps` (~300 tokens), which is
the long tail that holds a rollout batch up. Each step is local (copy the next term, add it to
the last total), so a tiny model can learn it, and it errs more the longer it writes.

Rewards (see `api`): team score = the output agent's text is the integer answer. Under
``credit: per_agent`` the planner scores 1 for the exact first step, the solver for the
answer after its ``A=``, the verifier for its own answer. Format: a plan is ``d+d=n``; working
is steps ``[+-]d=n;`` then ``A=n``; an answer is one integer.

Keyed form (``workload.params.keyed: true``): each term carries its own lowercase letter,
``a7b+3c+5d-2e+8``, and each step of the working names the term it consumes,
``c+5=15;d-2=13;e+8=21;A=21`` (the plan is unchanged). A step is then three local moves a
tiny model learns fast: write the successor of the last key, copy what follows that key in
the question (a content match, not a count of positions), add it. Every key is one token of
the project's tokenizer, the same in question and working; 26 letters bound `max_steps` to 24.

Splits: a problem is held-out iff a hash of its unkeyed text falls under `heldout_fraction`
(so a chain is in the same split keyed or not); problem k of a split comes from its own seeded
RNG (rejecting the other split's problems), so any window is computed directly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flexmarl_core.workloads.answers import parse_int
from flexmarl_core.workloads.api import Problem, Split, WorkloadError
from flexmarl_core.workloads.base import (
    RuleWorkload,
    assign_roles,
    check_count,
    check_split,
    hash_fraction,
    parse_params,
)

Role = Literal["plan", "work", "answer"]

_SPLIT_SALT = "flexmarl-longtail"
_PLAN_RE = re.compile(r"(\d)([+-])(\d)=(\d+)")
_WORK_RE = re.compile(r"(?:[+-]\d=\d+;)*A=(\d+)")
_KEYED_WORK_RE = re.compile(r"(?:[a-z][+-]\d=\d+;)*A=(\d+)")
_STEP_RE = re.compile(r"([+-])(\d)=(\d+);")
_TERM_RE = re.compile(r"[+-]?\d")
_KEYS = "abcdefghijklmnopqrstuvwxyz"
#: keyed working names one letter per term: terms <= 26, steps = terms - 2
MAX_KEYED_STEPS = len(_KEYS) - 2
_UNKEY = {ord(k): None for k in _KEYS}
#: Longest working the parsers look at: a degenerate output cannot make scoring slow.
MAX_TEXT_CHARS = 4096


class LongTailParams(BaseModel):
    """`workload.params` for `kind: longtail`."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(48, ge=1, le=400, description="Most working steps (terms - 2).")
    tail_exponent: float = Field(
        1.1, gt=0.0, le=10.0,
        description="Power law of the step count: P(s) ~ (s + 1) ** -tail_exponent. Smaller = "
        "heavier tail.",
    )
    max_total: int = Field(99, ge=9, le=999, description="Running totals stay in 0..max_total.")
    heldout_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of the problem space reserved for held-out."
    )
    work_credit: Literal["answer", "steps"] = Field(
        "answer",
        description="The 'work' agent's own score under credit: per_agent. answer: 1 for the "
        "right number after A=. steps: the share of its working that is right, counting the "
        "steps that match the reference in order up to the first slip, plus the answer: "
        "(right prefix + right answer) / (steps + 1). With totals in 0..9 a guessed answer is "
        "right one time in ten, so 'answer' pays chance hits on long problems as much as "
        "real working; 'steps' pays each right step.",
    )
    keyed: bool = Field(
        False,
        description="Each term carries a letter key (a7b+3c+5) and each working step names "
        "the key of the term it consumes (c+5=..;): the next term is found by content match "
        "instead of by counting positions. Needs max_steps <= 24 (26 letters).",
    )
    roles: dict[str, Role] = Field(
        default_factory=dict,
        description="Agent -> 'plan', 'work' or 'answer'. Default: 'planner' plans, 'solver' "
        "writes the working, every other agent answers.",
    )

    @model_validator(mode="after")
    def _keys_suffice(self) -> LongTailParams:
        if self.keyed and self.max_steps > MAX_KEYED_STEPS:
            raise ValueError(
                f"max_steps={self.max_steps} with keyed: true needs {self.max_steps + 2} keys; "
                f"there are {len(_KEYS)} letters, so max_steps must be <= {MAX_KEYED_STEPS}"
            )
        return self


def _signed(t: int) -> str:
    return f"{'+' if t >= 0 else '-'}{abs(t)}"


def _step(i: int, t: int, total: int, keyed: bool) -> str:
    """One step of working: term i (keyed: with its letter) and the running total after it."""
    return f"{_KEYS[i] if keyed else ''}{_signed(t)}={total};"


def question(terms: list[int], keyed: bool = False) -> str:
    """``7+3-2``, or keyed ``a7b+3c-2``: the problem text of signed terms."""
    if keyed and len(terms) > len(_KEYS):
        raise WorkloadError(f"{len(terms)} terms need more than the {len(_KEYS)} keys")
    keys = _KEYS[:len(terms)] if keyed else [""] * len(terms)
    return keys[0] + str(terms[0]) + "".join(k + _signed(t) for k, t in zip(keys[1:], terms[1:], strict=True))


def working(terms: list[int], keyed: bool = False) -> tuple[str, str, int]:
    """(plan, working, answer) for signed terms ``[7, 3, 5, -2, 8]``; keyed steps name their
    term's key (``c+5=15;``)."""
    total = terms[0] + terms[1]
    plan = f"{terms[0]}{_signed(terms[1])}={total}"
    steps = []
    for i, t in enumerate(terms[2:], start=2):
        total += t
        steps.append(_step(i, t, total, keyed))
    return plan, "".join(steps) + f"A={total}", total


def parse_terms(text: str, keyed: bool = False) -> list[int] | None:
    """``7+3-2`` (keyed: ``a7b+3c-2``, keys in order from a) -> [7, 3, -2]; None unless it is
    one-digit terms joined by + and - in that form."""
    if len(text) > MAX_TEXT_CHARS:
        return None
    if keyed:
        keys = re.sub(r"[+-]?\d", "", text)
        if not _KEYS.startswith(keys) or not re.fullmatch(r"a\d(?:[b-z][+-]\d)+", text):
            return None
        text = text.translate(_UNKEY)
    elif not re.fullmatch(r"\d(?:[+-]\d)+", text):
        return None
    return [int(t) for t in _TERM_RE.findall(text)]


def work_answer(text: str, keyed: bool = False) -> int | None:
    """The answer after ``A=`` of well-formed working (keyed: every step starts with a key),
    else None."""
    pattern = _KEYED_WORK_RE if keyed else _WORK_RE
    m = pattern.fullmatch(text.strip()) if len(text) <= MAX_TEXT_CHARS else None
    return int(m.group(1)) if m else None


class LongTailWorkload(RuleWorkload):
    """Seeded running-sum chains with a power-law length; see the module docstring."""

    _MAX_TRIES = 2000

    def __init__(
        self, agents: list[str], output_agent: str, params: Mapping[str, Any], **kwargs: Any
    ):
        super().__init__(agents, output_agent, **kwargs)
        self.params = parse_params(LongTailParams, params, "longtail")
        self.roles: dict[str, Role] = assign_roles(
            self.params.roles, agents, {"planner": "plan", "solver": "work"}, "answer")
        if self.roles[output_agent] == "plan":
            raise WorkloadError(
                f"output agent {output_agent!r} has role 'plan'; the team answer must come from a "
                "'work' or 'answer' agent (set workload.params.roles or team.output)"
            )
        s = range(self.params.max_steps + 1)
        self._weights = [(k + 1) ** -self.params.tail_exponent for k in s]

    # -- problems -----------------------------------------------------------------------------

    def heldout_description(self, n: int) -> str:
        p = self.params
        return (
            f"{n} generated held-out running-sum chains (2..{p.max_steps + 2} one-digit terms, "
            f"power-law length, exponent {p.tail_exponent}; the {p.heldout_fraction:.0%} of the "
            "problem space whose text hash is held out)"
        )

    def split_of(self, text: str) -> Split:
        # Keys are dropped before hashing: a chain lands in one split, keyed or not.
        frac = hash_fraction(text.translate(_UNKEY), _SPLIT_SALT)
        return "heldout" if frac < self.params.heldout_fraction else "train"

    def _terms(self, rng: random.Random) -> list[int]:
        steps = rng.choices(range(self.params.max_steps + 1), weights=self._weights)[0]
        hi = self.params.max_total
        terms = [rng.randint(1, 9)]
        total = terms[0]
        for _ in range(steps + 1):
            d = rng.randint(1, 9)
            # Keep the running total in 0..hi: the sign flips where the draw would leave it.
            # Below hi = 17 some totals fit neither sign of a large digit (5 + 9, 5 - 9): the
            # digit is then drawn again among those that fit (never happens at hi >= 17, so
            # those problems are unchanged).
            if d > max(hi - total, total):
                d = rng.randint(1, max(hi - total, total))
            sign = 1 if rng.random() < 0.5 else -1
            if not 0 <= total + sign * d <= hi:
                sign = -sign
            terms.append(sign * d)
            total += sign * d
        return terms

    def problems(self, split: Split, n: int, seed: int, offset: int = 0) -> list[Problem]:
        split = check_split(split)
        check_count(n, offset)
        out = []
        for k in range(offset, offset + n):
            for attempt in range(self._MAX_TRIES):
                terms = self._terms(random.Random(f"{seed}/{split}/{k}/{attempt}"))
                text = question(terms, self.params.keyed)
                if self.split_of(text) == split:
                    break
            else:  # pragma: no cover - heldout_fraction is bounded away from 0 and 1
                raise WorkloadError(f"no {split} problem found in {self._MAX_TRIES} tries")
            plan, work, answer = working(terms, self.params.keyed)
            out.append(Problem(
                input_id=f"l{seed}{split[0]}{k}", text=text, answer=str(answer),
                meta={"plan": plan, "working": work, "steps": len(terms) - 2, "split": split},
            ))
        return out

    # -- scoring ------------------------------------------------------------------------------

    def _role_answer(self, agent: str, text: str) -> int | None:
        return work_answer(text, self.params.keyed) if self.roles[agent] == "work" else parse_int(text)

    def team_score(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        got = self._role_answer(self.output_agent, outputs.get(self.output_agent, ""))
        return 1.0 if got is not None and str(got) == problem.answer else 0.0

    def agent_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float | None:
        text = outputs.get(agent, "")
        if self.roles[agent] == "plan":
            return 1.0 if text.strip() == problem.meta["plan"] else 0.0
        got = self._role_answer(agent, text)
        right = 1.0 if got is not None and str(got) == problem.answer else 0.0
        if self.roles[agent] == "work" and self.params.work_credit == "steps":
            return (working_prefix(text, str(problem.meta["working"])) + right) / (problem.meta["steps"] + 1)
        return right

    def format_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float:
        text = outputs.get(agent, "").strip()
        role = self.roles[agent]
        if role == "plan":
            ok = _PLAN_RE.fullmatch(text) is not None
        else:
            ok = self._role_answer(agent, text) is not None
        return 1.0 if ok else 0.0

    # -- demonstrations -----------------------------------------------------------------------

    def demonstration(self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]) -> str:
        if agent not in self.roles:
            raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")
        role = self.roles[agent]
        if role == "plan":
            return str(problem.meta["plan"])
        return str(problem.meta["working"]) if role == "work" else problem.answer

    def perturbation(self, problem: Problem, agent: str, rng: random.Random) -> str:
        """A plausible slip: one step's total off by 1-3, carried through the rest of the
        working (so the answer a downstream agent sees is wrong the way a solver's would be)."""
        if agent not in self.roles:
            raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")
        keyed = self.params.keyed
        terms = parse_terms(problem.text, keyed)
        if terms is None:
            raise WorkloadError(f"problem {problem.input_id!r}: {problem.text!r} is not a chain")
        slip = rng.choice([-3, -2, -1, 1, 2, 3])
        at = rng.randint(1, len(terms) - 1)  # the step whose total slips (1 = the plan's)
        total, plan, steps = terms[0], "", []
        for i, t in enumerate(terms[1:], start=1):
            total += t + (slip if i == at else 0)
            total = max(total, 0)
            if i == 1:
                plan = f"{terms[0]}{_signed(t)}={total}"
            else:
                steps.append(_step(i, t, total, keyed))
        role = self.roles[agent]
        if role == "plan":
            return plan
        if str(total) == problem.answer:  # the clamp at 0 can undo the slip
            total = int(problem.answer) + 1
        return "".join(steps) + f"A={total}" if role == "work" else str(total)


def working_prefix(text: str, reference: str) -> int:
    """How many of `reference`'s steps `text` writes right, in order from its start, before
    its first slip (``+5=15;-2=13;A=13`` against ``+5=15;-2=12;...``: 1)."""
    pos = n = 0
    for step in reference.split(";")[:-1]:  # the last piece is A=<answer>
        if not text.startswith(step + ";", pos):
            break
        pos += len(step) + 1
        n += 1
    return n


def step_count(text: str) -> int:
    """Working steps written in `text`, keyed or not (for length-vs-difficulty reports)."""
    return len(_STEP_RE.findall(text))
