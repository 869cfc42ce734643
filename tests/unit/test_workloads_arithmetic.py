"""The arithmetic team workload: problems, splits, rewards, demonstrations, config."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest

from flexmarl_core.config import TeamConfig, WorkloadConfig, load_config
from flexmarl_core.meg import MEG
from flexmarl_core.workloads import ArithmeticWorkload, Problem, WorkloadError, make_workload
from flexmarl_core.workloads.arithmetic import evaluate, parse, reductions, render

REPO = Path(__file__).resolve().parents[2]
AGENTS = ["planner", "solver", "verifier"]


def team(agents: list[str] = AGENTS) -> TeamConfig:
    tpl = {
        "planner": "Q:{input}\nP:",
        "solver": "Q:{input}\nP:{planner}\nA:",
        "verifier": "Q:{input}\nA:{solver}\nV:",
    }
    if agents == ["solver"]:
        tpl["solver"] = "Q:{input}\nA:"
    edges = [
        e
        for e in ("planner -> solver", "solver -> verifier")
        if set(e.split(" -> ")) <= set(agents)
    ]
    return TeamConfig.model_validate(
        {"agents": [{"name": a, "template": tpl[a]} for a in agents], "edges": edges}
    )


def arith(credit: str = "team", format_weight: float = 0.1, **params: object) -> ArithmeticWorkload:
    cfg = WorkloadConfig(
        kind="arithmetic", credit=credit, format_weight=format_weight, params=params
    )
    wl = make_workload(cfg, team())
    assert isinstance(wl, ArithmeticWorkload)
    return wl


# -- expressions ------------------------------------------------------------------------------


def test_render_parse_round_trip_and_precedence() -> None:
    wl = arith(n_operands=5, max_result=999)
    for p in wl.problems("train", 300, seed=3):
        tree = parse(p.text)
        assert tree is not None and render(tree) == p.text
        assert str(evaluate(tree)) == p.answer
    assert evaluate(parse("2+3*4")) == 14  # type: ignore[arg-type]
    assert evaluate(parse("2-(3-1)")) == 0  # type: ignore[arg-type]
    assert render(parse("(3+4)*2")) == "(3+4)*2"  # type: ignore[arg-type]
    assert parse(" ( 7 ) * 2 ") == ("*", 7, 2)


@pytest.mark.parametrize(
    "bad", ["", "3+", "-3", "3 4", "(3+4", "3/4", "x", "3+4)", "(" * 200 + "1"]
)
def test_parse_rejects_malformed(bad: str) -> None:
    assert parse(bad) is None


def test_reductions_are_leftmost_first() -> None:
    assert [render(t) for t in reductions(parse("(3+4)*2-5"))] == ["7*2-5"]  # type: ignore[arg-type]
    assert [render(t) for t in reductions(parse("3*2+4*5"))] == ["6+4*5", "3*2+20"]  # type: ignore[arg-type]
    assert reductions(parse("3+4")) == [7]  # type: ignore[arg-type]


# -- problems ---------------------------------------------------------------------------------


def test_problems_are_deterministic_windows_of_one_stream() -> None:
    wl = arith()
    a = wl.problems("train", 20, seed=7)
    assert a == wl.problems("train", 20, seed=7)
    assert wl.problems("train", 5, seed=7, offset=10) == a[10:15]
    assert [p.text for p in wl.problems("train", 20, seed=8)] != [p.text for p in a]
    ids = [p.input_id for p in wl.problems("train", 500, seed=7)]
    assert len(set(ids)) == len(ids) and not any(":" in i for i in ids)


def test_splits_are_disjoint_across_seeds() -> None:
    wl = arith()
    train = {p.text for s in (0, 1) for p in wl.problems("train", 600, seed=s)}
    held = {p.text for s in (0, 1) for p in wl.problems("heldout", 150, seed=s)}
    assert train and held and not train & held
    assert all(wl.split_of(t) == "heldout" for t in held)
    assert wl.heldout_description(150) == (
        "150 generated held-out expressions (3 operands of 1..9, ops '+-*'; the 20% of the "
        "expression space whose text hash is held out)"
    )


def test_problem_values_stay_in_range_and_short() -> None:
    wl = arith()
    for p in wl.problems("train", 500, seed=0):
        tree = parse(p.text)
        assert tree is not None
        assert 0 <= int(p.answer) <= 99 and len(p.text) <= 12 and p.meta["steps"] == 2
        assert parse(p.meta["plan"]) in reductions(tree)


def test_bad_params_and_roles_give_clear_errors() -> None:
    with pytest.raises(WorkloadError, match="unknown_knob"):
        arith(unknown_knob=1)
    with pytest.raises(WorkloadError, match="ops"):
        arith(ops="+/")
    with pytest.raises(WorkloadError, match="unknown agent"):
        arith(roles={"critic": "plan"})
    with pytest.raises(WorkloadError, match="role 'plan'"):
        arith(roles={"verifier": "plan"})
    with pytest.raises(WorkloadError, match=r"split 'test'"):
        arith().problems("test", 1, 0)  # type: ignore[arg-type]
    with pytest.raises(WorkloadError, match="max_result"):
        arith(n_operands=8, ops="*", max_value=9, max_result=1).problems("train", 1, 0)
    with pytest.raises(WorkloadError, match="path is not used"):
        make_workload(WorkloadConfig(kind="arithmetic", path="x.jsonl"), team())


def test_format_weight_and_credit_config_errors() -> None:
    with pytest.raises(WorkloadError, match=r"format_weight=1.5 must be in \[0, 1\]"):
        arith(format_weight=1.5)
    cfg = WorkloadConfig(agent_rewards={"solver": "math:fabs"})
    with pytest.raises(WorkloadError, match="credit: per_agent"):
        make_workload(cfg, team())


# -- rewards ----------------------------------------------------------------------------------

P = Problem("x1", "(3+4)*2", "14", {"plan": "7*2"})
GOOD = {"planner": "7*2", "solver": "14", "verifier": "14"}


def test_team_credit_rewards() -> None:
    wl = arith("team", 0.1)
    assert wl.reward(P, GOOD) == {"planner": 1.0, "solver": 1.0, "verifier": 1.0}
    # The solver was wrong but the verifier fixed it: the team is right, so all are paid.
    r = wl.reward(P, {"planner": "8*2", "solver": "16", "verifier": "14"})
    assert r == {"planner": 1.0, "solver": 1.0, "verifier": 1.0}
    # Wrong but well-formed: format only. Malformed: nothing (or format of the others).
    r = wl.reward(P, {"planner": "7*2", "solver": "14", "verifier": "15"})
    assert r == pytest.approx({"planner": 0.1, "solver": 0.1, "verifier": 0.1})
    r = wl.reward(P, {"planner": "7*", "solver": "14!", "verifier": "fourteen"})
    assert r == {"planner": 0.0, "solver": 0.0, "verifier": 0.0}
    assert wl.is_correct(P, GOOD) and not wl.is_correct(P, {"verifier": "15"})


def test_per_agent_credit_rewards() -> None:
    wl = arith("per_agent", 0.1)
    r = wl.reward(P, {"planner": "8*2", "solver": "16", "verifier": "14"})
    assert r == pytest.approx({"planner": 0.1, "solver": 0.1, "verifier": 1.0})
    r = wl.reward(P, {"planner": "7*2", "solver": "14", "verifier": " 15 "})
    assert r == pytest.approx({"planner": 1.0, "solver": 1.0, "verifier": 0.1})
    # Missing outputs are malformed; the answer must be the whole output.
    r = wl.reward(P, {"planner": "(7)*2", "solver": "14 because"})
    assert r == pytest.approx({"planner": 1.0, "solver": 0.0, "verifier": 0.0})


def test_turn_credit_pays_each_round_its_own_answer() -> None:
    # P is (3+4)*2 = 14: rounds "13", "14", then the last round's share as given
    wl = arith("per_agent", 0.1, turn_credit=True)
    assert wl.turn_rewards(P, "solver", ["13", "14", "x"], 0.5) == pytest.approx([0.1, 1.0, 0.5])
    assert wl.turn_rewards(P, "planner", ["7*2", "9"], 0.3) == pytest.approx([1.0, 0.3])
    # off, or under team credit: every round gets the last round's share
    assert arith("per_agent", 0.1).turn_rewards(P, "solver", ["13", "14"], 0.5) == [0.5, 0.5]
    assert arith("team", 0.1, turn_credit=True).turn_rewards(P, "solver", ["13", "14"], 0.5) == [0.5, 0.5]


def test_planner_may_take_any_legal_first_step() -> None:
    wl = arith("per_agent", 0.0)
    p = Problem("x2", "3*2+4*5", "26", {"plan": "6+4*5"})
    for plan, want in [("6+4*5", 1.0), ("3*2+20", 1.0), ("26", 0.0), ("6+20", 0.0), ("5+4*5", 0.0)]:
        assert wl.reward(p, {"planner": plan})["planner"] == want, plan


def test_format_weight_zero_is_pure_correctness() -> None:
    wl = arith("team", 0.0)
    assert wl.reward(P, {"verifier": "15"}) == {"planner": 0.0, "solver": 0.0, "verifier": 0.0}


# -- demonstrations ---------------------------------------------------------------------------


@pytest.mark.parametrize("credit", ["team", "per_agent"])
def test_demonstration_following_team_always_earns_full_reward(credit: str) -> None:
    wl = arith(credit, 0.1)
    meg = MEG.from_config(team())
    for p in wl.problems("train", 150, seed=1) + wl.problems("heldout", 50, seed=1):
        outs: dict[str, str] = {}
        for agent in meg.agent_names:
            parents = {a: outs[a] for a in meg.agent_parents(agent)}
            meg.render_prompt(agent, p.text, parents)  # every template renders
            outs[agent] = wl.demonstration(p, agent, parents)
        assert wl.is_correct(p, outs)
        assert wl.reward(p, outs) == {a: 1.0 for a in AGENTS}


def test_demonstrations_aim_at_the_team_answer_despite_wrong_parents() -> None:
    wl = arith("per_agent")
    assert wl.demonstration(P, "solver", {"planner": "8*2"}) == "14"
    assert wl.demonstration(P, "verifier", {"solver": "16"}) == "14"
    assert wl.demonstration(P, "planner", {}) == "7*2"
    with pytest.raises(WorkloadError, match="unknown agent"):
        wl.demonstration(P, "critic", {})


def test_perturbations_are_wrong_but_well_formed() -> None:
    wl = arith("per_agent", 0.1)
    rng = random.Random(0)
    for p in wl.problems("train", 200, seed=2):
        bad = {a: wl.perturbation(p, a, rng) for a in AGENTS}
        assert wl.reward(p, bad) == pytest.approx({a: 0.1 for a in AGENTS})


def test_single_agent_team_and_pickling() -> None:
    cfg = WorkloadConfig(kind="arithmetic")
    wl = make_workload(cfg, team(["solver"]))
    p = wl.problems("train", 1, 0)[0]
    assert wl.output_agent == "solver" and wl.demonstration(p, "solver", {}) == p.answer
    clone = pickle.loads(pickle.dumps(arith("per_agent")))
    assert clone.problems("heldout", 5, 4) == arith().problems("heldout", 5, 4)
    assert clone.reward(P, GOOD) == {a: 1.0 for a in AGENTS}


def test_recommended_config_is_short_for_tiny_models() -> None:
    cfg = load_config(REPO / "configs" / "arith_team.yaml")
    wl = make_workload(cfg.workload, cfg.team)
    meg = MEG.from_config(cfg.team)
    assert meg.output == "verifier" and meg.agent_names == AGENTS
    longest_prompt = longest_output = 0
    for p in wl.problems("train", 300, cfg.seed):
        outs: dict[str, str] = {}
        for agent in meg.agent_names:
            parents = {a: outs[a] for a in meg.agent_parents(agent)}
            longest_prompt = max(longest_prompt, len(meg.render_prompt(agent, p.text, parents)))
            outs[agent] = wl.demonstration(p, agent, parents)
            # Characters bound tokens from above for a byte-level BPE.
            assert len(outs[agent]) < cfg.agent(agent).sampling.max_new_tokens
        longest_output = max(longest_output, *map(len, outs.values()))
    assert longest_prompt < 60 and longest_output < 16
