"""The long-tail reasoning team: lengths that follow difficulty, rewards, demonstrations, config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.models import get_tokenizer
from flexmarl_core.workloads import LongTailWorkload, WorkloadError, make_workload
from flexmarl_core.workloads.longtail import parse_terms, question, step_count, work_answer, working
from tests._models_util import cache_dir

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "longtail_team.yaml"


def workload(**overrides: str) -> LongTailWorkload:
    cfg = load_config(CONFIG, [f"workload.params.{k}={v}" for k, v in overrides.items()])
    wl = make_workload(cfg.workload, cfg.team)
    assert isinstance(wl, LongTailWorkload)
    return wl


def test_working_is_the_running_sum():
    plan, work, answer = working([7, 3, 5, -2, 8])
    assert (plan, work, answer) == ("7+3=10", "+5=15;-2=13;+8=21;A=21", 21)
    assert working([4, -1]) == ("4-1=3", "A=3", 3)
    assert parse_terms("7+3+5-2+8") == [7, 3, 5, -2, 8]
    assert parse_terms("7+") is None and parse_terms("17+3") is None
    assert work_answer("+5=15;A=15") == 15 and work_answer("+5=15;A=") is None
    assert step_count(work) == 3


def test_problems_are_deterministic_disjoint_and_in_range():
    wl = workload()
    a = wl.problems("train", 300, seed=0)
    assert [p.text for p in a] == [p.text for p in wl.problems("train", 300, seed=0)]
    assert [p.text for p in a[100:]] == [p.text for p in wl.problems("train", 200, seed=0, offset=100)]
    held = {p.text for p in wl.problems("heldout", 300, seed=0)}
    assert not held & {p.text for p in a}
    for p in a:
        terms = parse_terms(p.text)
        assert terms is not None and 2 <= len(terms) <= wl.params.max_steps + 2
        total = 0
        for t in terms:
            total += t
            assert 0 <= total <= wl.params.max_total, p.text
        assert str(total) == p.answer
        assert work_answer(p.meta["working"]) == total


def test_sampled_length_follows_difficulty_with_a_long_tail():
    """Demonstrated working (what SFT teaches the solver to write) spans a few tokens to a few
    hundred, its length set by the number of terms, with most problems short."""
    wl, tok = workload(), get_tokenizer(cache_dir())
    ps = wl.problems("train", 1000, seed=0)
    lens = sorted(len(tok.encode(p.meta["working"], add_special_tokens=False)) for p in ps)
    p50, p90, top = lens[500], lens[900], lens[-1]
    assert lens[0] <= 6 and top >= 150, (lens[0], top)
    assert p50 < 40 and p90 > 3 * p50, (p50, p90)  # most are short, the tail is long
    # Length grows with difficulty: each step is 5 or 6 tokens (a one- or two-digit total),
    # plus 3 or 4 for the answer.
    for p in ps:
        n, s = len(tok.encode(p.meta["working"], add_special_tokens=False)), p.meta["steps"]
        assert 5 * s + 3 <= n <= 6 * s + 4, (p.text, n)
    # Fits the solver's budget in the shipped config.
    cfg = load_config(CONFIG)
    assert top < cfg.agent("solver").sampling.max_new_tokens


def test_rewards_per_agent_and_format():
    wl = workload()
    p = wl.problems("train", 5, seed=1)[3]
    right = {"planner": p.meta["plan"], "solver": p.meta["working"], "verifier": p.answer}
    assert wl.reward(p, right) == {"planner": 1.0, "solver": 1.0, "verifier": 1.0}
    wrong_answer = str(int(p.answer) + 1)
    wrong = {"planner": "1+1=3", "solver": "+1=2;A=" + wrong_answer, "verifier": wrong_answer}
    r = wl.reward(p, wrong)
    # Well-formed but wrong: the format term only (format_weight 0.1 in the config).
    assert r == {"planner": pytest.approx(0.1), "solver": pytest.approx(0.1), "verifier": pytest.approx(0.1)}
    assert wl.reward(p, {"planner": "??", "solver": "A=", "verifier": "x"}) == {
        "planner": 0.0, "solver": 0.0, "verifier": 0.0}
    assert wl.is_correct(p, right) and not wl.is_correct(p, wrong)


def test_steps_credit_pays_the_right_prefix_of_the_working():
    wl = workload(work_credit="steps", max_total="9")
    p = next(q for q in wl.problems("train", 200, seed=0) if q.meta["steps"] == 3)
    ref = p.meta["working"]  # three steps, then A=
    steps = ref.split(";")
    with_answer = {"planner": p.meta["plan"], "verifier": p.answer}
    def solver(text: str) -> float:
        return wl.agent_score(p, "solver", {**with_answer, "solver": text})
    assert solver(ref) == 1.0
    # First step right, second slipped: 1 of 3 steps, wrong answer -> 1/4.
    slipped = steps[1][:-1] + str((int(steps[1][-1]) + 1) % 10)
    assert solver(";".join([steps[0], slipped, *steps[2:-1]]) + ";A=" + str((int(p.answer) + 1) % 10)) == 0.25
    # A guessed right answer without the working earns only its own share.
    assert solver("A=" + p.answer) == 0.25
    # Right steps after a slip do not count: the prefix stops at the first mistake.
    assert solver(";".join(["+0=0", *steps[1:]])) == 0.25
    # The default credit is the answer alone, and the team score never changes.
    assert workload(max_total="9").agent_score(p, "solver", {**with_answer, "solver": "A=" + p.answer}) == 1.0
    assert wl.team_score(p, with_answer) == 1.0


def test_demonstrations_include_the_working_and_perturbations_are_wrong():
    wl = workload()
    rng = random.Random(0)
    for p in wl.problems("train", 50, seed=2):
        assert wl.demonstration(p, "solver", {}) == p.meta["working"]
        assert wl.demonstration(p, "planner", {}) == p.meta["plan"]
        assert wl.demonstration(p, "verifier", {}) == p.answer
        slip = wl.perturbation(p, "solver", rng)
        assert work_answer(slip) is not None and str(work_answer(slip)) != p.answer
        assert wl.perturbation(p, "verifier", rng) != p.answer


def test_bad_params_and_roles_fail_with_the_field():
    with pytest.raises(WorkloadError, match="max_steps"):
        workload(max_steps="0")
    with pytest.raises(WorkloadError, match="unknown agent"):
        workload(roles="{critic: plan}")
    with pytest.raises(WorkloadError, match="role 'plan'"):
        workload(roles="{verifier: plan}")


def test_evaluation_in_length_batches_gives_the_same_outputs():
    """`train.eval_batch` decodes held-out problems in batches grouped by question length (the
    long-tail team's answer length follows it); greedy outputs are each row's own, so the
    outputs and the accuracy equal one batch's (left padding is masked: padded keys add exact
    zeros, so no tolerance is needed)."""
    from flexmarl_core.driver.evaluate import evaluate_team
    from flexmarl_core.inference import make_inference_engine
    from flexmarl_core.meg import MEG
    from flexmarl_core.teams import team_shape
    from tests._models_util import tiny_model, tokenizer

    # tiny-1m everywhere and short answers: a random model writes to max_new_tokens.
    cfg = load_config(CONFIG, ["team.agents.solver.model.preset=tiny-1m",
                               "team.agents.solver.sampling.max_new_tokens=12"])
    meg = MEG.from_config(cfg.team)
    wl = make_workload(cfg.workload, cfg.team)
    engines = {a: make_inference_engine(cfg.agent(a), tiny_model(seed=i), tokenizer())
               for i, a in enumerate(meg.agent_names)}
    held = wl.problems("heldout", 10, seed=0)
    team = team_shape(cfg)
    one = evaluate_team(team, wl, engines, held, seed=0)
    split = evaluate_team(team, wl, engines, held, seed=0, batch=3)
    assert split["outputs"] == one["outputs"] and split["accuracy"] == one["accuracy"]
    assert len({len(p.text) for p in held}) > 3  # the batches really regroup the problems


def test_sft_chunk_budget_is_part_of_the_warm_start_key_only_when_set():
    from flexmarl_core.driver.sft import warm_start_key

    base = load_config(CONFIG, ["train.sft_chunk_tokens=null"])
    assert warm_start_key(base) != warm_start_key(load_config(CONFIG, ["train.sft_chunk_tokens=2048"]))
    # eval_batch changes nothing SFT produces (it only regroups the greedy decoding).
    assert warm_start_key(base) == warm_start_key(load_config(CONFIG, ["train.sft_chunk_tokens=null",
                                                                       "train.eval_batch=5"]))


def test_warm_start_key_holds_only_what_sft_reads():
    from flexmarl_core.driver.sft import warm_start_key

    key = warm_start_key(load_config(CONFIG))
    # RL-only fields: each staleness k and each RL loss or learning rate reuses one SFT.
    # (Helpers load the on-policy weights only: off, as staleness needs.)
    stale = ["codesign.max_staleness=2", "codesign.gradient_helpers=false"] + [
        f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in ("planner", "solver", "verifier")]
    for rl_only in (stale,
                    ["team.agents.planner.algorithm.lr=3e-5", "team.agents.solver.algorithm.clip_eps=0.1"],
                    ["team.agents.solver.algorithm.is_cap=4", "team.agents.solver.sampling.top_p=0.9"],
                    ["batch.inputs_per_iteration=6", "train.iterations=9"]):
        assert warm_start_key(load_config(CONFIG, rl_only)) == key, rl_only
    # Fields SFT reads: its own settings, the seed, and what the trainer and evaluation use.
    for sft in (["train.sft_lr=3e-4"], ["seed=1"], ["team.agents.solver.sampling.temperature=0.7"],
                ["team.agents.solver.algorithm.max_grad_norm=0.5"],
                ["team.agents.solver.sampling.max_new_tokens=40"], ["workload.heldout_size=64"]):
        assert warm_start_key(load_config(CONFIG, sft)) != key, sft


# -- keyed form (workload.params.keyed) ---------------------------------------------------------

LEARN = REPO / "configs" / "longtail_learn.yaml"


def keyed(**overrides: str) -> LongTailWorkload:
    return workload(keyed="true", max_steps="24", max_total="9", **overrides)


def _fingerprint(wl: LongTailWorkload) -> str:
    import hashlib
    import json

    rows = []
    for split in ("train", "heldout"):
        for p in wl.problems(split, 200, seed=0):
            rng = random.Random(p.input_id)
            agents = ("planner", "solver", "verifier")
            rows.append([p.input_id, p.text, p.answer, p.meta, [wl.demonstration(p, a, {}) for a in agents],
                         [wl.perturbation(p, a, rng) for a in agents]])
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def test_the_regime_configs_problems_are_unchanged_by_the_keyed_option():
    """Problems, demonstrations and perturbations of configs/longtail_team.yaml (keyed off by
    default), hashed before the option existed (main at 1ae5a23)."""
    assert _fingerprint(workload()) == "7e45310c934afa6cc05c46eb496c84c9f1c07c7a335737262a5b7e3d2348df79"


def test_keyed_question_and_working_name_each_term():
    assert question([7, 3, 5, -2, 8], keyed=True) == "a7b+3c+5d-2e+8"
    assert question([7, 3, 5, -2, 8]) == "7+3+5-2+8"
    assert working([7, 3, 5, -2, 8], keyed=True) == ("7+3=10", "c+5=15;d-2=13;e+8=21;A=21", 21)
    assert working([4, -1], keyed=True) == ("4-1=3", "A=3", 3)
    assert parse_terms("a7b+3c+5d-2e+8", keyed=True) == [7, 3, 5, -2, 8]
    # Keys out of order, missing or in an unkeyed text are not a keyed chain (and vice versa).
    for bad in ("a7c+3", "b7c+3", "7+3", "a7b+3c", "a7b+3+5", "a7bb+3"):
        assert parse_terms(bad, keyed=True) is None, bad
    assert parse_terms("a7b+3") is None
    assert work_answer("c+5=5;d-2=3;A=3", keyed=True) == 3
    assert work_answer("+5=5;A=5", keyed=True) is None and work_answer("c+5=5;A=5") is None
    assert work_answer("A=4", keyed=True) == 4
    assert step_count("c+5=5;d-2=3;A=3") == 2


def test_each_key_is_one_token_shared_by_question_and_working():
    """The solver's step copies by content match: the key it writes must be the very token
    that precedes the term in the question (one token each, digits one token each)."""
    tok = get_tokenizer(cache_dir())
    terms = [7] + [(-1) ** i * (1 + i % 9) for i in range(25)]
    q, (_, w, _) = question(terms, keyed=True), working(terms, keyed=True)
    q_ids = tok.encode("Q:" + q + "\nP:", add_special_tokens=False)
    w_ids = tok.encode("W:" + w + "\nV:", add_special_tokens=False)
    for key in "abcdefghijklmnopqrstuvwxyz":
        (kid,) = tok.encode(key, add_special_tokens=False)
        assert q_ids.count(kid) == 1, key
        if key >= "c":
            assert w_ids.count(kid) == 1, key  # a..b are the plan's terms
    # One step is key, sign, digit, '=', a one-digit total, ';': 6 tokens.
    assert len(tok.encode("c+5=5;", add_special_tokens=False)) == 6


def test_keyed_problems_are_the_unkeyed_chains_in_the_same_split():
    plain, wl = workload(max_steps="24", max_total="9"), keyed()
    for split in ("train", "heldout"):
        a, b = plain.problems(split, 300, seed=3), wl.problems(split, 300, seed=3)
        for p, k in zip(a, b, strict=True):
            assert parse_terms(k.text, keyed=True) == parse_terms(p.text)
            assert (k.answer, k.meta["steps"], k.meta["plan"]) == (p.answer, p.meta["steps"], p.meta["plan"])
            assert wl.split_of(k.text) == plain.split_of(p.text) == split
            assert work_answer(k.meta["working"], keyed=True) == int(k.answer)
    held = {p.text for p in wl.problems("heldout", 300, seed=0)}
    assert not held & {p.text for p in wl.problems("train", 300, seed=0)}


def test_keyed_scoring_and_steps_credit():
    wl = keyed(work_credit="steps")
    p = next(q for q in wl.problems("train", 300, seed=0) if q.meta["steps"] == 3)
    ref = p.meta["working"]
    steps = ref.split(";")
    others = {"planner": p.meta["plan"], "verifier": p.answer}

    def solver(text: str) -> float:
        return wl.agent_score(p, "solver", {**others, "solver": text})

    assert solver(ref) == 1.0 and wl.is_correct(p, {**others, "solver": ref})
    # The wrong key is a slip even with the right term and total.
    wrong_key = "z" + steps[0][1:]
    assert solver(";".join([wrong_key, *steps[1:]])) == pytest.approx(1 / 4)
    # Unkeyed steps are not keyed working: no answer, no format.
    unkeyed = ";".join(s[1:] for s in steps[:-1]) + ";" + steps[-1]
    assert solver(unkeyed) == 0.0 and wl.format_score(p, "solver", {"solver": unkeyed}) == 0.0
    assert wl.format_score(p, "solver", {"solver": ref}) == 1.0
    assert wl.format_score(p, "planner", {"planner": p.meta["plan"]}) == 1.0


def test_keyed_demonstrations_and_perturbations():
    wl = keyed()
    rng = random.Random(0)
    for p in wl.problems("train", 80, seed=2):
        demo = wl.demonstration(p, "solver", {})
        assert demo == p.meta["working"] and step_count(demo) == p.meta["steps"]
        slip = wl.perturbation(p, "solver", rng)
        got = work_answer(slip, keyed=True)
        assert got is not None and str(got) != p.answer, slip
        # The slip keeps the keys: only the totals differ.
        assert [s[0] for s in slip.split(";")] == [s[0] for s in demo.split(";")]
        assert wl.perturbation(p, "verifier", rng) != p.answer


def test_keyed_needs_a_letter_per_term_and_the_learn_config_is_keyed():
    with pytest.raises(WorkloadError, match=r"max_steps.*keyed.*<= 24"):
        workload(keyed="true", max_steps="25")
    cfg = load_config(LEARN)
    wl = make_workload(cfg.workload, cfg.team)
    assert isinstance(wl, LongTailWorkload) and wl.params.keyed and wl.params.max_steps == 24
    tok = get_tokenizer(cache_dir())
    longest = max(len(tok.encode(p.meta["working"], add_special_tokens=False))
                  for p in wl.problems("train", 2000, seed=0))
    assert longest < cfg.agent("solver").sampling.max_new_tokens


def test_a_cache_moved_whole_keeps_its_warm_starts_and_an_edited_model_in_it_does_not(tmp_path):
    """A warm start made from a model inside the cache (as `bench/peer_trl.py`'s long start is)
    is keyed by the model's path relative to the cache: copied with its times, it is found."""
    import shutil

    import yaml

    from flexmarl_core.driver.sft import warm_start_key

    def config_on(cache: Path) -> Path:
        raw = yaml.safe_load((REPO / "configs" / "overhead.yaml").read_text())
        raw["team"]["agents"][0]["model"] = {"path": str(cache / "start")}
        raw["workload"].setdefault("params", {})["heldout_path"] = str(cache / "held.jsonl")  # a dataset too
        path = tmp_path / f"{cache.name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    first = tmp_path / "first"
    (first / "start").mkdir(parents=True)
    (first / "start" / "config.json").write_text("{}")
    (first / "start" / "model.safetensors").write_bytes(b"weights")
    (first / "held.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    key = warm_start_key(load_config(str(config_on(first))), first)
    moved = tmp_path / "moved"
    shutil.copytree(first, moved, copy_function=shutil.copy2)  # times travel, as with cp -a
    assert warm_start_key(load_config(str(config_on(moved))), moved) == key
    # Without the cache named, the absolute paths tell the two apart.
    assert warm_start_key(load_config(str(config_on(moved)))) != warm_start_key(load_config(str(config_on(first))))
    (moved / "start" / "model.safetensors").write_bytes(b"weights, trained on")  # another size: no clock tick needed
    assert warm_start_key(load_config(str(config_on(moved))), moved) != key
