"""Synthetic arithmetic for a planner -> solver -> verifier team, sized for tiny CPU models.

A problem is a short integer expression such as ``(3+4)*2``. Each agent does one small,
checkable thing and passes it on along the MEG edges:

* **planner** ("plan" role) rewrites the expression with one step done, the leftmost
  operation whose operands are both numbers (the innermost parentheses first):
  ``(3+4)*2`` -> ``7*2``.
* **solver** ("answer" role) reads the problem and the plan and writes the value: ``14``.
* **verifier** ("answer" role, the team output) reads the problem and the solver's answer
  and writes the final answer, keeping it or correcting it: ``14``.

Why this shape: prompts stay under ~25 characters and outputs under ~6 tokens; every
intermediate value is a non-negative integer <= `max_result` (no minus signs to learn);
the plan is a real partial result, so a wrong plan really misleads the solver and the
verifier has something to catch. Skew: the planner writes ~3x the tokens of the others, and
a verifier that re-derives the answer does the solver's work again, so per-agent decode
cost is uneven from the start.

Rewards (see `api`): team score = the output agent's text is exactly the integer answer.
Under ``credit: per_agent`` a plan-role agent scores 1 when its text parses to *any* legal
one-step reduction of the problem (not only the canonical one); an answer-role agent scores
1 when its own text is the answer. Format: a plan parses as an expression; an answer is
one integer and nothing else.

Splits: an expression is held-out iff a hash of its text falls under `heldout_fraction`,
so train and held-out never share an expression, whatever the seed. Problem k of a split is
drawn from its own seeded RNG (rejecting expressions of the other split), so any window
``offset .. offset+n`` is computed directly. Streams are i.i.d. draws: an expression can
recur (with a different input id).

Recommended team (also in ``configs/arith_team.yaml``)::

    team:
      agents:
        - name: planner
          template: "Q:{input}\\nP:"
          sampling: {temperature: 1.0, max_new_tokens: 12, stop: ["\\n"]}
        - name: solver
          template: "Q:{input}\\nP:{planner}\\nA:"
          sampling: {temperature: 1.0, max_new_tokens: 6, stop: ["\\n"]}
        - name: verifier
          template: "Q:{input}\\nA:{solver}\\nV:"
          sampling: {temperature: 1.0, max_new_tokens: 6, stop: ["\\n"]}
      edges: ["planner -> solver", "solver -> verifier"]
    workload:
      kind: arithmetic
      credit: per_agent
      format_weight: 0.1
      params: {n_operands: 3, max_value: 9, ops: "+-*", max_result: 99}
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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

Role = Literal["plan", "answer"]

#: An expression tree: an int leaf or (op, left, right).
Node = int | tuple[str, "Node", "Node"]

PRECEDENCE = {"+": 1, "-": 1, "*": 2}
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|([-+*()]))")
#: Longest text the parser accepts; model outputs are a few tokens, and the cap keeps a
#: degenerate "((((((" from recursing deep.
MAX_EXPR_CHARS = 128
_SPLIT_SALT = "flexmarl-arith"


# -- expressions ------------------------------------------------------------------------------


def apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def evaluate(node: Node) -> int:
    if isinstance(node, int):
        return node
    op, left, right = node
    return apply(op, evaluate(left), evaluate(right))


def render(node: Node, parent_prec: int = 0, is_right: bool = False) -> str:
    """Text with the fewest parentheses that still parses back to *this* tree.

    A right operand of equal precedence keeps its parentheses (``2-(3-1)``, and also
    ``2+(3+1)``) because the parser is left-associative: the text then pins down which
    step comes first, which is what the planner is graded on.
    """
    if isinstance(node, int):
        return str(node) if node >= 0 else f"({node})"
    op, left, right = node
    prec = PRECEDENCE[op]
    text = render(left, prec, False) + op + render(right, prec, True)
    needs = prec < parent_prec or (is_right and prec == parent_prec)
    return f"({text})" if needs else text


def parse(text: str) -> Node | None:
    """Parse ``+ - *``, parentheses and non-negative integers; None for anything else."""
    if len(text) > MAX_EXPR_CHARS:
        return None
    tokens: list[str] = []
    pos, s = 0, text.rstrip()
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if not m:
            return None
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        return None
    i = 0

    def peek() -> str | None:
        return tokens[i] if i < len(tokens) else None

    def expr() -> Node | None:
        nonlocal i
        node = term()
        while node is not None and peek() in ("+", "-"):
            op = tokens[i]
            i += 1
            rhs = term()
            node = None if rhs is None else (op, node, rhs)
        return node

    def term() -> Node | None:
        nonlocal i
        node = factor()
        while node is not None and peek() == "*":
            i += 1
            rhs = factor()
            node = None if rhs is None else ("*", node, rhs)
        return node

    def factor() -> Node | None:
        nonlocal i
        tok = peek()
        if tok is None:
            return None
        if tok.isdigit():
            i += 1
            return int(tok)
        if tok == "(":
            i += 1
            node = expr()
            if node is None or peek() != ")":
                return None
            i += 1
            return node
        return None

    node = expr()
    return node if node is not None and i == len(tokens) else None


def reductions(node: Node) -> list[Node]:
    """Every tree one step away: one operation with two number operands replaced by its value.

    Ordered leftmost first, so ``reductions(t)[0]`` is the canonical plan.
    """
    if isinstance(node, int):
        return []
    op, left, right = node
    if isinstance(left, int) and isinstance(right, int):
        return [apply(op, left, right)]
    return [(op, lhs, right) for lhs in reductions(left)] + [
        (op, left, rhs) for rhs in reductions(right)
    ]


def _values(node: Node) -> list[int]:
    if isinstance(node, int):
        return [node]
    op, left, right = node
    return _values(left) + _values(right) + [evaluate(node)]


def count_ops(node: Node) -> int:
    return 0 if isinstance(node, int) else 1 + count_ops(node[1]) + count_ops(node[2])


# -- the workload -----------------------------------------------------------------------------


class ArithmeticParams(BaseModel):
    """`workload.params` for `kind: arithmetic`."""

    model_config = ConfigDict(extra="forbid")

    n_operands: int = Field(3, ge=2, le=8, description="Numbers per expression (steps = n - 1).")
    max_value: int = Field(9, ge=1, le=999, description="Operands are drawn from 1..max_value.")
    ops: str = Field("+-*", description="Operators to draw from, a subset of '+-*'.")
    max_result: int = Field(
        99, ge=1, description="Every intermediate value and the answer lie in 0..max_result."
    )
    heldout_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of the expression space reserved for held-out."
    )
    roles: dict[str, Role] = Field(
        default_factory=dict,
        description="Agent -> 'plan' or 'answer'. Default: an agent named 'planner' plans, "
        "every other agent answers.",
    )
    handoffs: dict[str, str] = Field(
        default_factory=dict,
        description="Agent -> the tool its first turn calls, with no arguments, to hand the problem "
        "on (a program's handoff, like the OpenAI Agents SDK's `transfer_to_solver`); what the SFT "
        "warm start demonstrates for that turn.",
    )
    turn_credit: bool = Field(
        False, description="With credit: per_agent, each round of an agent but its last is paid for its "
        "own output (an answer: is it the answer; a plan: is it a legal step) instead of the last round's "
        "(debates, refine loops).",
    )

    @field_validator("ops")
    @classmethod
    def _ops(cls, v: str) -> str:
        bad = sorted(set(v) - set(PRECEDENCE))
        if not v or bad:
            raise ValueError(f"ops {v!r} must be a non-empty subset of '+-*' (bad: {bad})")
        return "".join(dict.fromkeys(v))


class ArithmeticWorkload(RuleWorkload):
    """Seeded multi-step integer expressions; see the module docstring for the team."""

    _MAX_TRIES = 2000

    def __init__(
        self, agents: list[str], output_agent: str, params: Mapping[str, Any], **kwargs: Any
    ):
        super().__init__(agents, output_agent, **kwargs)
        self.params = parse_params(ArithmeticParams, params, "arithmetic")
        self.roles: dict[str, Role] = assign_roles(self.params.roles, agents, {"planner": "plan"}, "answer")
        unknown = sorted(set(self.params.handoffs) - set(agents))
        if unknown:
            raise WorkloadError(f"workload.params.handoffs names {unknown}, not agents of the team {agents}")
        if self.roles[output_agent] != "answer":
            raise WorkloadError(
                f"output agent {output_agent!r} has role 'plan'; the team answer must come from an "
                "'answer' agent (set workload.params.roles or team.output)"
            )

    # -- problems -----------------------------------------------------------------------------

    def heldout_description(self, n: int) -> str:
        p = self.params
        return (
            f"{n} generated held-out expressions ({p.n_operands} operands of 1..{p.max_value}, "
            f"ops {p.ops!r}; the {p.heldout_fraction:.0%} of the expression space whose text "
            "hash is held out)"
        )

    def split_of(self, text: str) -> Split:
        return (
            "heldout"
            if hash_fraction(text, _SPLIT_SALT) < self.params.heldout_fraction
            else "train"
        )

    def _random_tree(self, rng: random.Random, n: int) -> Node:
        if n == 1:
            return rng.randint(1, self.params.max_value)
        k = rng.randint(1, n - 1)
        return (
            rng.choice(self.params.ops),
            self._random_tree(rng, k),
            self._random_tree(rng, n - k),
        )

    def _draw(self, split: Split, seed: int, k: int) -> Node:
        hi = self.params.max_result
        for attempt in range(self._MAX_TRIES):
            rng = random.Random(f"{seed}/{split}/{k}/{attempt}")
            tree = self._random_tree(rng, self.params.n_operands)
            if all(0 <= v <= hi for v in _values(tree)) and self.split_of(render(tree)) == split:
                return tree
        raise WorkloadError(
            f"no {split} expression found in {self._MAX_TRIES} tries with params "
            f"{self.params.model_dump(exclude={'roles'})}: raise max_result or lower n_operands"
        )

    def problems(self, split: Split, n: int, seed: int, offset: int = 0) -> list[Problem]:
        split = check_split(split)
        check_count(n, offset)
        out = []
        for k in range(offset, offset + n):
            tree = self._draw(split, seed, k)
            out.append(
                Problem(
                    input_id=f"a{seed}{split[0]}{k}",
                    text=render(tree),
                    answer=str(evaluate(tree)),
                    meta={
                        "plan": render(reductions(tree)[0]),
                        "steps": count_ops(tree),
                        "split": split,
                    },
                )
            )
        return out

    # -- scoring ------------------------------------------------------------------------------

    def team_score(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        return self._answer_score(problem, outputs.get(self.output_agent, ""))

    def _answer_score(self, problem: Problem, text: str) -> float:
        value = parse_int(text)
        return 1.0 if value is not None and str(value) == problem.answer else 0.0

    def plan_correct(self, problem: Problem, plan: str) -> bool:
        """Whether `plan` is any legal one-step reduction of the problem."""
        tree, got = parse(problem.text), parse(plan)
        return tree is not None and got is not None and got in reductions(tree)

    def agent_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float | None:
        text = outputs.get(agent, "")
        if self.roles[agent] == "plan":
            return 1.0 if self.plan_correct(problem, text) else 0.0
        return self._answer_score(problem, text)

    def turn_rewards(self, problem: Problem, agent: str, turns: list[str], final: float) -> list[float]:
        """Under `turn_credit` and `credit: per_agent`, rounds before the last score their own
        text as the last round is scored (the built-in `agent_score`, format term included; an
        agent with its own `agent_rewards` callable keeps the default); the last keeps `final`."""
        if not (self.params.turn_credit and self.credit == "per_agent") or agent in self.agent_rewards:
            return super().turn_rewards(problem, agent, turns, final)
        w = self.format_weight
        own = [(1.0 - w) * (self.agent_score(problem, agent, {agent: t}) or 0.0)
               + w * self.format_score(problem, agent, {agent: t}) for t in turns[:-1]]
        return [*own, final]

    def format_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float:
        text = outputs.get(agent, "")
        ok = parse(text) is not None if self.roles[agent] == "plan" else parse_int(text) is not None
        return 1.0 if ok else 0.0

    # -- demonstrations -----------------------------------------------------------------------

    def demonstration(self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]) -> str:
        if agent not in self.roles:
            raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")
        return problem.meta["plan"] if self.roles[agent] == "plan" else problem.answer

    def tool_turn(self, problem: Problem, agent: str, k: int) -> tuple[str, dict[str, Any]] | str | None:
        """An agent in `handoffs` hands on in its first turn; every other turn is demonstrated
        as usual."""
        tool = self.params.handoffs.get(agent)
        return (tool, {}) if tool is not None and k == 0 else None

    def perturbation(self, problem: Problem, agent: str, rng: random.Random) -> str:
        """A plausible mistake: the plan with its new number off by 1-3, or the answer such a
        plan leads to (so a downstream agent sees the errors an upstream one really makes)."""
        if agent not in self.roles:
            raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")
        tree = parse(problem.text)
        if tree is None:
            raise WorkloadError(
                f"problem {problem.input_id!r}: {problem.text!r} is not an expression"
            )
        wrong_plan = _off_by_some(tree, rng)
        if self.roles[agent] == "plan":
            return render(wrong_plan)
        value = evaluate(wrong_plan)
        if value < 0 or str(value) == problem.answer:
            value = int(problem.answer) + rng.randint(1, 3)
        return str(value)


def _off_by_some(tree: Node, rng: random.Random) -> Node:
    """The canonical reduction with the computed number changed by 1-3 (kept >= 0)."""
    if isinstance(tree, int):
        return tree + rng.randint(1, 3)
    op, left, right = tree
    if isinstance(left, int) and isinstance(right, int):
        v = apply(op, left, right)
        d = rng.randint(1, 3)
        return v + d if v - d < 0 or rng.random() < 0.5 else v - d
    if reductions(left):
        return (op, _off_by_some(left, rng), right)
    return (op, left, _off_by_some(right, rng))
