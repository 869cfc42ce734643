"""Program synthesis for a coder -> tester team, rewarded by running the code in the sandbox.

A problem is a one-line function over an integer or a list of integers, specified by a
docstring and two examples, with hidden tests::

    "x times 3 plus 1" f(2)=7 f(5)=16

* **coder** (the team output) writes the body of ``def f(x): return ...``: ``x*3+1``.
* **tester** reads the spec and the coder's body and writes up to four tests,
  ``f(0)==1;f(4)==13``: argument and value literals, parsed (never executed) here.

Rewards (see `api`). Team score: the fraction of the hidden tests the coder's program passes,
run in `flexmarl_core.sandbox` (a program that fails, hangs or misbehaves scores 0). Under
``credit: per_agent`` the tester scores 0 if any of its tests fails on the reference
solution (a test that rejects right programs is wrong), else the fraction of the wrong
programs its tests reject: the problem's mutants (a changed constant, a neighbouring
function) plus the coder's own program when that one failed the hidden tests. The tester is
thus paid for tests that separate right programs from wrong ones, including the team's.
Format: the coder's body parses as an expression and its program was not stopped by the
sandbox (so a hostile program earns 0, format term included); the tester's text parses as tests.

Splits: a function (its canonical body) is held-out iff a hash of it falls under
`heldout_fraction`, so held-out measures functions never seen in training; problem k of a
split comes from its own seeded RNG, like `arithmetic`.
"""

from __future__ import annotations

import ast
import random
import re
import warnings
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flexmarl_core.sandbox import FATAL, Limits, Verdict, run_tests, set_concurrency
from flexmarl_core.workloads.api import Problem, Split, WorkloadError
from flexmarl_core.workloads.base import (
    RuleWorkload,
    check_count,
    check_split,
    hash_fraction,
    parse_params,
)

#: family -> (docstring, body, takes a list); {a} in 2..max_const, {b} in 1..max_const
FAMILIES: dict[str, tuple[str, str, bool]] = {
    "mul_add": ("x times {a} plus {b}", "x*{a}+{b}", False),
    "mul_sub": ("x times {a} minus {b}", "x*{a}-{b}", False),
    "add_mul": ("x plus {b} times {a}", "(x+{b})*{a}", False),
    "sum_add": ("sum of x plus {b}", "sum(x)+{b}", True),
    "max_mul": ("max of x times {a}", "max(x)*{a}", True),
    "len_add": ("length of x plus {b}", "len(x)+{b}", True),
}
_TEST_RE = re.compile(r"f\((.{1,40}?)\)==(-?\d{1,6})")
_SPLIT_SALT = "flexmarl-code"
MAX_TESTS = 4
MAX_BODY_CHARS = 120


class CodeParams(BaseModel):
    """`workload.params` for `kind: code`."""

    model_config = ConfigDict(extra="forbid")

    families: list[str] = Field(default_factory=lambda: list(FAMILIES),
                                description=f"Function families to draw from: {list(FAMILIES)}.")
    max_const: int = Field(9, ge=2, le=99, description="Constants a in 2..max_const, b in 1..max_const.")
    hidden_tests: int = Field(5, ge=1, le=20, description="Hidden tests per problem.")
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Share of functions held out.")
    coder: str = Field("coder", description="The agent that writes the body (the team output).")
    tester: str | None = Field("tester", description="The agent that writes tests (or null).")
    cpu_s: float = Field(1.0, gt=0, description="Sandbox CPU seconds per program.")
    wall_s: float = Field(3.0, gt=0, description="Sandbox wall seconds per program.")
    memory_mb: int = Field(256, ge=64, description="Sandbox address space per program.")
    threads: int = Field(4, ge=0, description="Threads a program may start besides its own "
                         "(a thread bomb stops there).")
    hide: list[str] = Field(default_factory=list, description="Folders the programs never see "
                            "(the run folder, the store) besides the working directory and home.")
    python: str | None = Field(None, description="Interpreter the programs run under (default: "
                               "the worker's base interpreter).")
    max_concurrent: int | None = Field(
        None, ge=1, description="Sandboxed programs at once per worker process (default: cores).")


def _evaluate(body: str, arg: Any) -> Any:
    """A *trusted* body (generated here, never a model's) on one argument."""
    return eval(body, {"__builtins__": {"sum": sum, "max": max, "len": len}}, {"x": arg})


def _parse(text: str) -> ast.Expression:
    """An expression's tree, without the SyntaxWarning that text like "1x" prints first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(text, mode="eval")


def _passes(body: str, tests: list[tuple[Any, int]]) -> list[bool]:
    """Each test on a trusted body; a test the body cannot even run on (max of []) fails."""
    out = []
    for arg, value in tests:
        try:
            out.append(_evaluate(body, arg) == value)
        except (ValueError, TypeError):
            out.append(False)
    return out


def parse_tests(text: str) -> list[tuple[Any, int]]:
    """`f(ARG)==VALUE` pairs out of the tester's text, literals only (`ast.literal_eval`)."""
    out = []
    for m in _TEST_RE.finditer(text[:400]):
        try:
            arg = ast.literal_eval(_parse(m.group(1)))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if type(arg) is int or (type(arg) is list and all(type(v) is int for v in arg)):
            out.append((arg, int(m.group(2))))
        if len(out) == MAX_TESTS:
            break
    return out


def program(body: str) -> str:
    return f"def f(x):\n    return {body.strip()[:MAX_BODY_CHARS]}\n"


def _assert(arg: Any, value: Any) -> str:
    return f"assert candidate({arg!r}) == {value!r}"


class CodeWorkload(RuleWorkload):
    """Seeded one-line functions; see the module docstring for the team and the rewards."""

    _MAX_TRIES = 2000

    def __init__(self, agents: list[str], output_agent: str, params: Mapping[str, Any], **kwargs: Any):
        super().__init__(agents, output_agent, **kwargs)
        self.params = parse_params(CodeParams, params, "code")
        p = self.params
        bad = sorted(set(p.families) - set(FAMILIES))
        if bad or not p.families:
            raise WorkloadError(f"workload.params.families {p.families} must be a non-empty subset of {list(FAMILIES)}")
        roles = [r for r in (p.coder, p.tester) if r is not None]
        missing = [r for r in roles if r not in agents]
        if missing:
            raise WorkloadError(f"workload.params names agent(s) {missing} not in the team {agents}")
        if output_agent != p.coder:
            raise WorkloadError(f"the team output must be the coder {p.coder!r}, not {output_agent!r}")
        others = sorted(set(agents) - set(roles))
        if others:
            raise WorkloadError(f"kind=code has a coder and a tester; agent(s) {others} have no role")
        self.limits = Limits(cpu_s=p.cpu_s, wall_s=p.wall_s, memory_mb=p.memory_mb, threads=p.threads,
                             hide=tuple(p.hide), python=p.python)
        self._cache: dict[tuple[str, str, str], tuple[Verdict, int]] = {}
        self._apply_concurrency()

    def _apply_concurrency(self) -> None:
        if self.params.max_concurrent is not None:
            set_concurrency(self.params.max_concurrent)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._apply_concurrency()  # the worker process that unpickles it bounds its sandboxes

    # -- problems -----------------------------------------------------------------------------

    def heldout_description(self, n: int) -> str:
        p = self.params
        return (f"{n} generated held-out functions (families {p.families}, constants up to "
                f"{p.max_const}; the {p.heldout_fraction:.0%} of functions whose hash is held out), "
                f"{p.hidden_tests} hidden tests each")

    def _arg(self, rng: random.Random, is_list: bool) -> Any:
        if is_list:
            return [rng.randint(0, 9) for _ in range(rng.randint(1, 4))]
        return rng.randint(0, 12)

    def _draw(self, split: Split, seed: int, k: int) -> Problem:
        p = self.params
        for attempt in range(self._MAX_TRIES):
            rng = random.Random(f"{seed}/{split}/{k}/{attempt}")
            fam = rng.choice(p.families)
            doc, body, is_list = FAMILIES[fam]
            a, b = rng.randint(2, p.max_const), rng.randint(1, p.max_const)
            body = body.format(a=a, b=b)
            if (hash_fraction(body, _SPLIT_SALT) < p.heldout_fraction) != (split == "heldout"):
                continue
            args: list[Any] = []
            while len(args) < 2 + p.hidden_tests:
                arg = self._arg(rng, is_list)
                if arg not in args:
                    args.append(arg)
            cases = [[arg, _evaluate(body, arg)] for arg in args]
            examples = " ".join(f"f({arg!r})={v}".replace(" ", "") for arg, v in cases[:2])
            text = f'"{doc.format(a=a, b=b)}" {examples}'
            return Problem(
                input_id=f"c{seed}{split[0]}{k}", text=text, answer=body,
                meta={"split": split, "family": fam, "list": is_list, "examples": cases[:2],
                      "hidden": cases[2:], "mutants": self._mutants(fam, a, b, rng)},
            )
        raise WorkloadError(f"no {split} function found in {self._MAX_TRIES} tries with params "
                            f"{self.params.model_dump()}: add families or raise max_const")

    def _mutants(self, fam: str, a: int, b: int, rng: random.Random) -> list[str]:
        """Wrong programs near the right one: a constant off by one, a neighbouring family."""
        doc, body, is_list = FAMILIES[fam]
        near = [f for f, (_, _, lst) in FAMILIES.items() if lst == is_list and f != fam]
        out = [body.format(a=a + 1, b=b), body.format(a=a, b=b + 1), body.format(a=max(2, a - 1), b=b - 1)]
        if near:
            out.append(FAMILIES[rng.choice(near)][1].format(a=a, b=b))
        right = body.format(a=a, b=b)
        return [m for m in dict.fromkeys(out) if m != right]

    def problems(self, split: Split, n: int, seed: int, offset: int = 0) -> list[Problem]:
        split = check_split(split)
        check_count(n, offset)
        return [self._draw(split, seed, k) for k in range(offset, offset + n)]

    # -- scoring ------------------------------------------------------------------------------

    def _judge(self, problem: Problem, outputs: Mapping[str, str]) -> tuple[Verdict, int]:
        """One sandbox run of the coder's program: the hidden tests, then the tester's tests
        (`results[len(hidden):]`). Returns the verdict and the number of hidden tests."""
        body = outputs.get(self.params.coder, "")
        tests_text = outputs.get(self.params.tester, "") if self.params.tester else ""
        key = (problem.input_id, body, tests_text)
        if key not in self._cache:
            hidden = [_assert(arg, v) for arg, v in problem.meta["hidden"]]
            mine = [_assert(arg, v) for arg, v in parse_tests(tests_text)]
            verdict = run_tests(program(body), hidden + mine, self.limits, entry="f")
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = (verdict, len(hidden))
        return self._cache[key]

    def team_score(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        if not outputs.get(self.params.coder, "").strip():
            return 0.0
        verdict, n = self._judge(problem, outputs)
        return sum(verdict.results[:n]) / n

    def agent_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float | None:
        if agent != self.params.tester:
            return None
        tests = parse_tests(outputs.get(agent, ""))
        if not tests or not all(_passes(problem.answer, tests)):
            return 0.0
        mutants = problem.meta["mutants"]
        killed = sum(not all(_passes(m, tests)) for m in mutants)
        wrong = len(mutants)
        verdict, n = self._judge(problem, outputs)
        if outputs.get(self.params.coder, "").strip() and not all(verdict.results[:n]):
            # The team's own wrong program: did the tester's tests (run on it) reject it?
            wrong += 1
            killed += not all(verdict.results[n:])
        return killed / wrong if wrong else 1.0

    def format_score(self, problem: Problem, agent: str, outputs: Mapping[str, str]) -> float:
        text = outputs.get(agent, "")
        if agent == self.params.coder:
            # Well-formed: an expression that ran to the end of its tests. A program the
            # sandbox had to stop (forbidden, limits, exit) earns nothing at all.
            try:
                _parse(text.strip()[:MAX_BODY_CHARS])
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                return 0.0
            return 1.0 if text.strip() and self._judge(problem, outputs)[0].reason not in FATAL else 0.0
        return 1.0 if parse_tests(text) else 0.0

    # -- demonstrations -----------------------------------------------------------------------

    def demonstration(self, problem: Problem, agent: str, parent_outputs: Mapping[str, str]) -> str:
        if agent == self.params.coder:
            return problem.answer
        if agent == self.params.tester:
            # A test off the examples: it tells the right program from most mutants.
            zero: Any = [0] if problem.meta["list"] else 0
            cases = [(zero, _evaluate(problem.answer, zero)), *problem.meta["hidden"][:1]]
            return ";".join(f"f({arg!r})=={v}".replace(" ", "") for arg, v in cases)
        raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")

    def perturbation(self, problem: Problem, agent: str, rng: random.Random) -> str:
        """A plausible wrong output: a mutant body for the coder (so the tester sees wrong
        code), a test with an off-by-one value for the tester."""
        if agent == self.params.coder:
            return rng.choice(problem.meta["mutants"])
        if agent == self.params.tester:
            arg, v = problem.meta["hidden"][0]
            return f"f({arg!r})=={v + rng.choice((-1, 1))}".replace(" ", "")
        raise WorkloadError(f"unknown agent {agent!r}; agents: {self.agents}")
