"""The code team workload: problems, splits, sandboxed rewards per agent, demonstrations."""

from __future__ import annotations

import pickle
import random
import warnings
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.teams import team_shape
from flexmarl_core.workloads import CodeWorkload, WorkloadError, make_workload
from flexmarl_core.workloads.code import parse_tests

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg():
    return load_config(REPO / "configs" / "code_team.yaml", [])


@pytest.fixture(scope="module")
def wl(cfg) -> CodeWorkload:
    return make_workload(cfg.workload, cfg.team)


def test_problems_are_deterministic_and_splits_share_no_function(wl):
    train = wl.problems("train", 200, seed=0)
    assert [p.text for p in train[:20]] == [p.text for p in wl.problems("train", 20, seed=0)]
    assert wl.problems("train", 5, seed=0, offset=7)[0].text == train[7].text
    held = wl.problems("heldout", 200, seed=0)
    assert not {p.answer for p in train} & {p.answer for p in held}
    assert len({p.meta["family"] for p in train}) == 6
    assert len({p.input_id for p in train + held}) == 400


def test_demonstrations_earn_full_reward_through_the_sandbox(wl):
    for p in wl.problems("heldout", 6, seed=1):
        demo = {a: wl.demonstration(p, a, {}) for a in wl.agents}
        assert wl.reward(p, demo) == {"coder": 1.0, "tester": 1.0}, (p.text, demo)
        assert wl.is_correct(p, demo)


def test_wrong_partial_hostile_and_malformed_programs(wl):
    p = next(q for q in wl.problems("train", 50, seed=0) if q.meta["family"] == "mul_add")
    a, b = (int(s) for s in p.answer.replace("x*", "").split("+"))
    tester = wl.demonstration(p, "tester", {})
    # Right on x == 0 only: passes the hidden tests that happen to use 0, no more.
    partial = f"x*{a}+{b} if x == 0 else 0"
    n0 = sum(arg == 0 for arg, _ in p.meta["hidden"])
    assert wl.team_score(p, {"coder": partial}) == pytest.approx(n0 / len(p.meta["hidden"]))
    wrong = wl.reward(p, {"coder": f"x*{a}+{b + 1}", "tester": tester})
    assert wrong["coder"] == pytest.approx(0.1)  # well-formed, every hidden test failed
    for hostile in ("__import__('os')._exit(0)", "__import__('socket')", "[0] * 10 ** 10",
                    "__import__('ctypes')", "__import__('os').fork()"):
        r = wl.reward(p, {"coder": hostile, "tester": tester})
        assert r["coder"] == 0.0, hostile
    # Claiming success or exiting inside a test is a wrong answer (format term only).
    for liar in ("print('PASS') or 0", "__import__('sys').exit(0)"):
        assert wl.reward(p, {"coder": liar, "tester": tester})["coder"] == pytest.approx(0.1)
    assert wl.reward(p, {"coder": "x*(", "tester": "nonsense"}) == {"coder": 0.0, "tester": 0.0}


def test_tester_is_paid_for_tests_that_separate_right_from_wrong(wl):
    p = next(q for q in wl.problems("train", 50, seed=0) if q.meta["family"] == "mul_add")
    right = p.answer
    a, b = (int(s) for s in right.replace("x*", "").split("+"))
    # A wrong test (fails on the right program) scores 0.
    assert wl.agent_score(p, "tester", {"coder": right, "tester": f"f(1)=={a + b + 1}"}) == 0.0
    # f(0)==b tells apart the mutants that change b, not those that only change a.
    only_b = wl.agent_score(p, "tester", {"coder": right, "tester": f"f(0)=={b}"})
    both = wl.agent_score(p, "tester", {"coder": right, "tester": f"f(0)=={b};f(1)=={a + b}"})
    assert 0.0 < only_b < both == 1.0
    # With the coder wrong, tests that also reject the coder's program count it as caught.
    wrong_coder = f"x*{a}+{b}+(x == 5)"
    caught = wl.agent_score(p, "tester", {"coder": wrong_coder, "tester": f"f(0)=={b};f(1)=={a + b};f(5)=={5 * a + b}"})
    missed = wl.agent_score(p, "tester", {"coder": wrong_coder, "tester": f"f(0)=={b};f(1)=={a + b}"})
    if any(arg == 5 for arg, _ in p.meta["hidden"]):
        assert caught == 1.0 and missed < 1.0


def test_parse_tests_takes_literals_only():
    assert parse_tests("f(3)==10;f([1,2])==3;f(__import__('os'))==1;f(1)==x") == [(3, 10), ([1, 2], 3)]
    assert len(parse_tests(";".join(f"f({i})=={i}" for i in range(9)))) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a malformed literal is skipped without a SyntaxWarning
        assert parse_tests("f(1x)==3;f(0b1)==1") == [(1, 1)]


def test_sft_demonstrations_and_perturbations_follow_the_meg(cfg, wl):
    problems = wl.problems("train", 8, seed=0)
    demos = team_shape(cfg).demonstrations(wl, problems, seed=0, rng=random.Random(0), perturb=0.5)
    assert [t for _, t in demos["coder"]] == [p.answer for p in problems]
    prompts = [pr for pr, _ in demos["tester"]]
    assert all(pr.startswith(p.text) and "\nC:" in pr for pr, p in zip(prompts, problems, strict=True))
    # Some tester prompts show a mutant, and the target stays the right tests.
    assert any(p.answer not in pr for pr, p in zip(prompts, problems, strict=True))


def test_pickled_workload_works_and_bad_params_are_one_line_errors(cfg, wl):
    again = pickle.loads(pickle.dumps(wl))
    p = again.problems("train", 1, seed=3)[0]
    assert again.team_score(p, {"coder": p.answer}) == 1.0
    bad = cfg.workload.model_copy(update={"params": {"families": ["nope"]}})
    with pytest.raises(WorkloadError, match="families"):
        make_workload(bad, cfg.team)
    bad = cfg.workload.model_copy(update={"params": {"max_const": 1}})
    with pytest.raises(WorkloadError, match="max_const"):
        make_workload(bad, cfg.team)
