"""A tool-using team: a planner and a solver reduce an expression over MEG rounds, the solver
calling a calculator shipped with the workload.

A problem is a flat expression of `n_operands` two-digit numbers (``47*23+19``), too large for
a tiny model to multiply in its head. Each MEG round does one reduction (``*`` before
``+``/``-``, then left to right); `team.rounds` is therefore `n_operands - 1`:

* **planner** (round 0) writes the operation that precedence says comes first: ``47*23``;
* **solver** calls the calculator on the round's operation and rewrites the expression with
  the result::

      [47*23]=1081;1081+19        round 0   (``=1081`` is the calculator's, inserted)
      [1081+19]=1100;1100         round 1   (the team answer: after the last ``;``)

The solver's ``]`` ends a call (`inference/tools.py` generates to it, runs `Calculator`,
inserts ``=<value>`` as unsampled, masked tokens, and lets the solver go on). The solver reads
its previous round through a recurrent edge, so round r works on round r-1's expression.
Rewards (see `api`): the team score is 1 when the final expression is the answer; under
``credit: per_agent`` the planner is paid for naming the operation that comes first.
Under ``params.turn_credit`` each solver round but the last is paid for its own reduction
(`turn_rewards`). Format: the solver's text has the call-result-expression shape, the
planner's is one operation.

A problem reads as the expression or, under ``params.phrasing: words``, in words (``47 times 23
plus 19``); the calls and the rewritten expressions are in symbols either way.

Splits: by a hash of the expression text (`heldout_fraction` held out), so held-out accuracy
measures expressions never trained on; problem k of a split comes from its own seeded RNG.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flexmarl_core.workloads.api import Problem, Split, WorkloadError
from flexmarl_core.workloads.base import (
    RuleWorkload,
    check_count,
    check_split,
    hash_fraction,
    parse_params,
)

_SPLIT_SALT = "flexmarl-calculator"
_CALL = re.compile(r"\s*(\d{1,6})\s*([+*-])\s*(\d{1,6})\s*")
_OP = re.compile(r"\d+[+*-]\d+")
_SOLVER = re.compile(r"\[\d+[+*-]\d+\]=-?\d+;\d+(?:[+*-]\d+)*")


class Calculator:
    """The deterministic tool: ``a op b`` (integers, ``+ - *``) -> ``=value``; anything else
    -> ``=?``. Called from inside a response between ``[`` and ``]``."""

    open = "["
    close = "]"

    def __init__(self, max_calls: int = 2) -> None:
        self.max_calls = max_calls

    def __call__(self, call: str) -> str:
        m = _CALL.fullmatch(call)
        if m is None:
            return "=?"
        return f"={apply(m.group(2), int(m.group(1)), int(m.group(3)))}"


class CalculatorParams(BaseModel):
    """`workload.params` for `kind: calculator`."""

    model_config = ConfigDict(extra="forbid")

    n_operands: int = Field(3, ge=2, le=6, description="Operands per expression; team.rounds must be n_operands - 1.")
    min_value: int = Field(10, ge=0, description="Smallest operand.")
    max_value: int = Field(99, ge=1, le=9999, description="Largest operand.")
    ops: str = Field("+-*", description="Operators to draw from (a subset of '+-*').")
    max_result: int = Field(9999, ge=1, description="Every intermediate value and the answer lie in 0..max_result.")
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Share of expressions held out.")
    max_calls: int = Field(2, ge=1, le=8, description="Calculator calls per solver response.")
    planner: str | None = Field("planner", description="The agent naming the first operation (or null).")
    solver: str = Field("solver", description="The agent that calls the calculator (the team output).")
    phrasing: Literal["symbols", "words"] = Field("symbols", description=(
        "How a problem reads: `symbols` (`47*23+19`) or `words` (`47 times 23 plus 19`), which "
        "the calculator calls translate back to symbols. A tiny model's embeddings of the rare "
        "operator symbols collapse together, so it copies the operands of a `symbols` problem "
        "but not its operator; it can read the operator of a `words` one."))
    turn_credit: bool = Field(False, description=(
        "Pay each solver round but the last for its own reduction (the call and the rewritten "
        "expression are exactly checkable) instead of the team's final answer."))


def apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def tokens(expr: str) -> list[str]:
    """``47*23+19`` -> ``['47', '*', '23', '+', '19']``."""
    return re.findall(r"\d+|[+*-]", expr)


def next_op(toks: list[str]) -> int:
    """Index of the operator reduced next: the first ``*``, else the first operator."""
    return toks.index("*") if "*" in toks else 1


def reduce_once(toks: list[str]) -> tuple[str, int, list[str]]:
    """One reduction: (the operation's text, its value, the rewritten expression's tokens)."""
    i = next_op(toks)
    a, op, b = toks[i - 1 : i + 2]
    v = apply(op, int(a), int(b))
    return f"{a}{op}{b}", v, [*toks[: i - 1], str(v), *toks[i + 2 :]]


def chain(expr: str) -> list[tuple[str, int, str]]:
    """Every round's (operation, value, rewritten expression) down to a single number."""
    out, toks = [], tokens(expr)
    while len(toks) > 1:
        op, v, toks = reduce_once(toks)
        out.append((op, v, "".join(toks)))
    return out


#: each operator as `phrasing: words` writes it
WORDS = {"+": "plus", "-": "minus", "*": "times"}


def in_words(expr: str) -> str:
    """``47*23+19`` -> ``47 times 23 plus 19``."""
    return " ".join(WORDS.get(t, t) for t in tokens(expr))


def final_answer(solver_text: str) -> str:
    """The team's answer: the solver's expression after its last ``;``, or, with no ``;`` (a
    program's own answer), the whole text; whitespace trimmed."""
    return solver_text.rsplit(";", 1)[-1].strip()


class CalculatorWorkload(RuleWorkload):
    """Seeded expressions; see the module docstring for the team, the tool and the rewards."""

    _MAX_TRIES = 2000

    def __init__(self, agents: list[str], output_agent: str, params: Mapping[str, Any], *,
                 rounds: int | None, **kwargs: Any):
        super().__init__(agents, output_agent, **kwargs)
        self.params = p = parse_params(CalculatorParams, params, "calculator")
        if not p.ops or set(p.ops) - set("+-*"):
            raise WorkloadError(f"workload.params.ops {p.ops!r} must be a non-empty subset of '+-*'")
        if p.min_value > p.max_value:
            raise WorkloadError(f"workload.params.min_value {p.min_value} > max_value {p.max_value}")
        roles = [r for r in (p.planner, p.solver) if r is not None]
        missing = [r for r in roles if r not in agents]
        if missing:
            raise WorkloadError(f"workload.params names agent(s) {missing} not in the team {agents}")
        others = sorted(set(agents) - set(roles))
        if others:
            raise WorkloadError(f"kind=calculator has a planner and a solver; agent(s) {others} have no role")
        if output_agent != p.solver:
            raise WorkloadError(f"the team output must be the solver {p.solver!r}, not {output_agent!r}")
        # rounds None: a program team, whose own tool loop calls the calculator (`tool_turn`)
        self._in_engine = rounds is not None
        if rounds is not None and rounds != p.n_operands - 1:
            raise WorkloadError(
                f"team.rounds={rounds}: kind=calculator reduces one operation per round, so "
                f"{p.n_operands} operands (workload.params.n_operands) need team.rounds={p.n_operands - 1}"
            )
        self.calculator = Calculator(p.max_calls)

    def tool(self, agent: str) -> Calculator | None:
        """The solver's calculator (`inference/tools.py` runs it inside its responses)."""
        return self.calculator if agent == self.params.solver and self._in_engine else None

    # -- problems -----------------------------------------------------------------------------

    def heldout_description(self, n: int) -> str:
        p = self.params
        return (f"{n} generated held-out expressions ({p.n_operands} operands of "
                f"{p.min_value}..{p.max_value}, ops {p.ops!r}, values 0..{p.max_result}; the "
                f"{p.heldout_fraction:.0%} whose hash is held out; written in {p.phrasing}), solved "
                f"with a calculator")

    def _draw(self, split: Split, seed: int, k: int) -> Problem:
        p = self.params
        for attempt in range(self._MAX_TRIES):
            rng = random.Random(f"{seed}/{split}/{k}/{attempt}")
            nums = [str(rng.randint(p.min_value, p.max_value)) for _ in range(p.n_operands)]
            ops = [rng.choice(p.ops) for _ in range(p.n_operands - 1)]
            text = "".join(t for pair in zip(nums, [*ops, ""], strict=True) for t in pair)
            steps = chain(text)
            if any(not 0 <= v <= p.max_result for _, v, _ in steps):
                continue
            if (hash_fraction(text, _SPLIT_SALT) < p.heldout_fraction) != (split == "heldout"):
                continue
            # the split hashes the expression, so both phrasings hold out the same ones
            shown = in_words(text) if p.phrasing == "words" else text
            return Problem(input_id=f"t{seed}{split[0]}{k}", text=shown, answer=str(steps[-1][1]),
                           meta={"split": split, "steps": [list(s) for s in steps]})
        raise WorkloadError(f"no {split} expression found in {self._MAX_TRIES} tries with params "
                            f"{p.model_dump()}: widen the values or raise max_result")

    def problems(self, split: Split, n: int, seed: int, offset: int = 0) -> list[Problem]:
        split = check_split(split)
        check_count(n, offset)
        return [self._draw(split, seed, k) for k in range(offset, offset + n)]

    # -- scoring ------------------------------------------------------------------------------

    def team_score(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        return 1.0 if final_answer(outputs.get(self.params.solver, "")) == problem.answer else 0.0

    def agent_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float | None:
        if agent != self.params.planner:
            return None
        return 1.0 if outputs.get(agent, "").strip() == problem.meta["steps"][0][0] else 0.0

    def format_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float:
        text = outputs.get(agent, "").strip()
        pattern = _SOLVER if agent == self.params.solver else _OP
        return 1.0 if pattern.fullmatch(text) else 0.0

    def turn_rewards(self, problem: Problem, agent: str, turns: list[str], final: float) -> list[float]:
        """Under `turn_credit`, solver round r < last scores 1 when it wrote exactly round r's
        reduction of the true chain (``[op]=v;rest``; the ``=v`` is the calculator's, so this
        pays the call and the rewrite); the last round keeps `final` (the team answer).
        Round r is judged against the true chain: after a wrong round r-1 no later round can
        be right, as with the team score."""
        if not (self.params.turn_credit and agent == self.params.solver):
            return super().turn_rewards(problem, agent, turns, final)
        steps, w = problem.meta["steps"], self.format_weight
        out = []
        for r, text in enumerate(turns[:-1]):
            op, v, rest = steps[min(r, len(steps) - 1)]
            right = text.strip() == f"[{op}]={v};{rest}"
            fmt = 1.0 if _SOLVER.fullmatch(text.strip()) else 0.0
            out.append((1.0 - w) * float(right) + w * fmt)
        return [*out, final]

    # -- demonstrations -----------------------------------------------------------------------

    def _round(self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]) -> int:
        """Which round a demonstration is for: round 0 has no previous solver output."""
        prev = parent_outputs.get(self.params.solver, "")
        if not prev:
            return 0
        # The previous round's expression has one operator fewer per round done so far.
        left = len(tokens(final_answer(prev)))
        return min(len(problem.meta["steps"]) - 1, self.params.n_operands - (left + 1) // 2)

    def tool_turn(self, problem: Problem, agent: str, k: int) -> tuple[str, dict[str, Any]] | str | None:
        """A program's solver with a `calculator(expression)` tool (a ReAct loop): turn k < the
        chain's length calls it on the k-th reduction (the expression rewritten by the turns
        before); the last turn answers the number."""
        if agent != self.params.solver:
            return None
        steps = problem.meta["steps"]
        if k < len(steps):
            return "calculator", {"expression": steps[k][0]}
        return problem.answer

    def demonstration(self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]) -> str:
        steps = problem.meta["steps"]
        r = self._round(problem, agent, parent_outputs)
        op, v, rest = steps[r]
        if agent == self.params.planner:
            return steps[0][0]
        if agent == self.params.solver:
            return f"[{op}]={v};{rest}"
        raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")
