"""User-defined workloads: datasets (JSONL, Parquet), callables, reward callables, GSM8K."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from flexmarl_core.config import TeamConfig, WorkloadConfig, load_config
from flexmarl_core.meg import MEG
from flexmarl_core.workloads import (
    CallableWorkload,
    DatasetWorkload,
    RewardCallable,
    WorkloadError,
    load_callable,
    make_workload,
)
from flexmarl_core.workloads.answers import answers_match, last_number
from flexmarl_core.workloads.dataset import gsm8k_answer

REPO = Path(__file__).resolve().parents[2]

TEAM = TeamConfig.model_validate(
    {
        "agents": [
            {"name": "planner", "template": "{input}\nplan:"},
            {"name": "solver", "template": "{input}\n{planner}\nanswer:"},
        ],
        "edges": ["planner -> solver"],
    }
)
FIELDS = {"input": "q", "answer": "a", "id": "qid", "split": "part", "demo.planner": "hint"}


def rows(n: int = 10) -> list[dict[str, Any]]:
    return [
        {
            "qid": f"q{i}",
            "q": f"what is {i} plus {i}?",
            "a": 2 * i,
            "part": "test" if i >= 8 else "train",
            "hint": f"{i}+{i}",
            "level": i % 3,
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, items: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))
    return path


def dataset(path: Path, base_dir: Path | None = None, **kw: Any) -> DatasetWorkload:
    cfg = WorkloadConfig(kind="dataset", path=str(path), **{"fields": FIELDS, **kw})
    wl = make_workload(cfg, TEAM, base_dir=base_dir)
    assert isinstance(wl, DatasetWorkload)
    return wl


def user_module(tmp_path: Path, source: str) -> str:
    """Write a uniquely named module into tmp_path; return its name."""
    name = f"fm_user_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(source)
    return name


# -- datasets ---------------------------------------------------------------------------------


def test_jsonl_field_mapping(tmp_path: Path) -> None:
    wl = dataset(write_jsonl(tmp_path / "d.jsonl", rows()))
    train = wl.problems("train", 8, seed=0)
    assert sorted(p.input_id for p in train) == [f"q{i}" for i in range(8)]
    p = next(p for p in train if p.input_id == "q3")
    assert (p.text, p.answer, p.meta["level"]) == ("what is 3 plus 3?", "6", 0)
    assert "d.jsonl: line 4" in p.meta["where"]
    assert wl.demonstration(p, "planner", {}) == "3+3"  # the demo.planner column
    assert wl.demonstration(p, "solver", {"planner": "oops"}) == "6"  # default: the answer
    assert {p.input_id for p in wl.problems("heldout", 99, seed=0)} == {"q8", "q9"}


def test_parquet_field_mapping(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows()), path)
    wl = dataset(path)
    assert sorted(p.input_id for p in wl.problems("train", 8, 0)) == [f"q{i}" for i in range(8)]
    p = wl.problems("heldout", 1, 0)[0]
    assert p.answer == str(2 * int(p.input_id[1:])) and "row" in p.meta["where"]
    assert wl.reward(p, {"planner": "x", "solver": f"it is {p.answer}"})["solver"] == 1.0


def test_relative_path_resolves_against_base_dir(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", rows())
    assert len(dataset(Path("d.jsonl"), base_dir=tmp_path).problems("train", 3, 0)) == 3
    with pytest.raises(WorkloadError, match="no such file"):
        dataset(Path("missing.jsonl"), base_dir=tmp_path)


def test_train_cycles_with_fresh_ids_and_heldout_never_repeats(tmp_path: Path) -> None:
    wl = dataset(write_jsonl(tmp_path / "d.jsonl", rows()))
    a = wl.problems("train", 20, seed=5)
    assert a == wl.problems("train", 20, seed=5) and a[4:9] == wl.problems("train", 5, 5, offset=4)
    ids = [p.input_id for p in a]
    assert len(set(ids)) == 20 and ids[8].endswith("~1") and ids[16].endswith("~2")
    assert sorted(p.text for p in a[:8]) == sorted(p.text for p in a[8:16])  # whole epochs
    assert len(wl.problems("heldout", 50, seed=5)) == 2


def test_hash_split_is_disjoint_and_seed_independent(tmp_path: Path) -> None:
    items = [{"question": f"question {i}", "answer": i} for i in range(300)]
    cfg = WorkloadConfig(kind="dataset", path=str(write_jsonl(tmp_path / "d.jsonl", items)))
    wl = make_workload(cfg, TEAM)
    held = {p.text for p in wl.problems("heldout", 300, seed=0)}
    assert held == {p.text for p in wl.problems("heldout", 300, seed=1)}
    assert 30 < len(held) < 90  # ~20%
    assert not held & {p.text for s in (0, 1) for p in wl.problems("train", 300, seed=s)}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"qid": "q2", "q": "x?"', r"line 3: not valid JSON"),
        ("[1, 2]", r"line 3: expected a JSON object"),
        (
            '{"qid": "q2", "a": 1, "part": "train", "hint": "h"}',
            r"line 3: no column 'q' \(workload.fields.input\)",
        ),
        (
            '{"qid": "q2", "q": "x?", "a": null, "part": "train", "hint": "h"}',
            r"line 3: column 'a'",
        ),
        (
            '{"qid": "q:2", "q": "x?", "a": 1, "part": "train", "hint": "h"}',
            r"line 3: input_id 'q:2'",
        ),
        (
            '{"qid": "q2", "q": "x?", "a": 1, "part": "later", "hint": "h"}',
            r"line 3: split 'later'",
        ),
        (
            '{"qid": "q0", "q": "x?", "a": 1, "part": "train", "hint": "h"}',
            r"duplicate input id 'q0' in .*bad.jsonl: line 1 and .*bad.jsonl: line 3",
        ),
    ],
)
def test_bad_row_error_names_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [*rows(2), line])
    with pytest.raises(WorkloadError, match=match) as exc:
        dataset(path)
    assert "bad.jsonl" in str(exc.value)


def test_bad_parquet_row_names_file_and_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = rows(3)
    data[2]["q"] = ""
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "bad.parquet")
    with pytest.raises(WorkloadError, match=r"bad.parquet: row 2: column 'q'"):
        dataset(tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(WorkloadError, match=r"junk.parquet: cannot read as Parquet"):
        dataset(tmp_path / "junk.parquet")


def test_pinned_split_overlap_leaves_train(tmp_path: Path) -> None:
    items = [{"q": "same", "a": 1, "s": "train"}, {"q": "same", "a": 1, "s": "test"}]
    items += [{"q": f"other {i}", "a": i, "s": "train"} for i in range(3)]
    path = write_jsonl(tmp_path / "d.jsonl", items)
    wl = dataset(path, fields={"input": "q", "answer": "a", "split": "s"})
    assert wl.dropped_from_train == 1 and [p.text for p in wl.problems("heldout", 5, 0)] == ["same"]
    assert "same" not in {p.text for p in wl.problems("train", 30, 0)}


def test_bad_dataset_config_errors(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows())
    with pytest.raises(WorkloadError, match="unknown key 'question'"):
        dataset(path, fields={"input": "q", "answer": "a", "question": "q"})
    with pytest.raises(WorkloadError, match=r"fields.demo.critic: unknown agent"):
        dataset(path, fields={"input": "q", "answer": "a", "demo.critic": "hint"})
    with pytest.raises(WorkloadError, match=r"must map \['answer'\]"):
        dataset(path, fields={"input": "q"})
    with pytest.raises(WorkloadError, match="unknown file type"):
        dataset(write_jsonl(tmp_path / "d.csv", rows()))
    with pytest.raises(WorkloadError, match="valid keys"):
        dataset(path, params={"heldout_frac": 0.1})
    with pytest.raises(WorkloadError, match="needs workload.path"):
        make_workload(WorkloadConfig(kind="dataset"), TEAM)
    empty = dataset(path, fields={"input": "q", "answer": "a"}, params={"heldout_fraction": 0.0})
    with pytest.raises(WorkloadError, match="held-out|heldout split is empty"):
        empty.problems("heldout", 1, 0)


def test_heldout_file_and_pickle_reloads(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"q": f"t{i}", "a": "yes"} for i in range(5)])
    held = write_jsonl(tmp_path / "held.jsonl", [{"q": f"h{i}", "a": "no"} for i in range(3)])
    cfg = WorkloadConfig(
        kind="dataset",
        path=str(train),
        fields={"input": "q", "answer": "a"},
        params={"heldout_path": str(held)},
    )
    wl = make_workload(cfg, TEAM)
    assert {p.input_id for p in wl.problems("heldout", 9, 0)} == {"h0", "h1", "h2"}
    blob = pickle.dumps(wl)
    assert b"t4" not in blob  # the pool stays behind; workers reload from the path
    assert pickle.loads(blob).problems("train", 5, 0) == wl.problems("train", 5, 0)


def test_heldout_file_makes_the_main_file_all_train(tmp_path: Path) -> None:
    """With params.heldout_path no row of the main file is hash-split into held-out (200 rows:
    a 20% hash split would take ~40 of them); held-out is exactly the other file."""
    items = [{"q": f"question {i}", "a": i} for i in range(200)]
    train = write_jsonl(tmp_path / "train.jsonl", items)
    held = write_jsonl(tmp_path / "test.jsonl", [{"q": f"exam {i}", "a": i} for i in range(7)])
    fields = {"input": "q", "answer": "a"}
    plain = dataset(train, fields=fields)
    assert 0 < len(plain.pools()["heldout"]) < 200  # without the file, the hash split applies
    wl = dataset(train, fields=fields, params={"heldout_path": str(held)})
    pools = wl.pools()
    assert sorted(p.text for p in pools["train"]) == sorted(r["q"] for r in items)
    assert [p.text for p in pools["heldout"]] == [f"exam {i}" for i in range(7)]
    assert wl.hashed_heldout == 0
    assert wl.heldout_description(128) == f"all 7 held-out problems from {held}"
    assert wl.heldout_description(5) == f"5 of 7 held-out problems from {held}"
    # Settings that would choose the held-out set some other way are refused, not ignored.
    with pytest.raises(WorkloadError, match=r"heldout_fraction=0.2 has no effect with params.heldout_path"):
        dataset(train, fields=fields, params={"heldout_path": str(held), "heldout_fraction": 0.2})
    with pytest.raises(WorkloadError, match=r"fields.split \('s'\) and params.heldout_path"):
        dataset(train, fields={**fields, "split": "s"}, params={"heldout_path": str(held)})


def test_heldout_description_names_the_split(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows())
    labelled = dataset(path)  # the 'part' column pins q8, q9 to held-out
    assert labelled.heldout_description(128) == (
        f"all 2 held-out problems from the rows of {path} whose 'part' column says held-out"
    )
    items = [{"question": f"question {i}", "answer": i} for i in range(300)]
    big = write_jsonl(tmp_path / "big.jsonl", items)
    hashed = make_workload(WorkloadConfig(kind="dataset", path=str(big)), TEAM)
    n = len(hashed.pools()["heldout"])  # type: ignore[attr-defined]
    assert hashed.heldout_description(10) == (
        f"10 of {n} held-out problems, a hash split (20%) of dataset {big}"
    )
    overlap = write_jsonl(tmp_path / "o.jsonl", [
        {"q": "same", "a": 1, "s": "train"}, {"q": "same", "a": 1, "s": "test"},
        {"q": "other", "a": 2, "s": "train"}])
    wl = dataset(overlap, fields={"input": "q", "answer": "a", "split": "s"})
    assert wl.heldout_description(9) == (
        f"1 held-out problem from the rows of {overlap} whose 's' column says held-out; "
        "1 train problem(s) repeating one were dropped"
    )


def test_gsm8k_folder_heldout_is_its_test_file(tmp_path: Path) -> None:
    def solved(i: int) -> dict[str, str]:
        return {"question": f"q {i}?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}

    write_jsonl(tmp_path / "train.jsonl", [solved(i) for i in range(20)])
    write_jsonl(tmp_path / "test.jsonl", [solved(i) for i in range(100, 104)])
    wl = make_workload(WorkloadConfig(kind="gsm8k", path=str(tmp_path)), TEAM)
    assert wl.heldout_description(128) == f"all 4 held-out problems from {tmp_path / 'test.jsonl'}"
    assert len(wl.pools()["train"]) == 20  # type: ignore[attr-defined]


def test_answer_matching_modes(tmp_path: Path) -> None:
    assert answers_match("so the total is $1,234.", "1234")
    assert answers_match("3.50", "3.5") and not answers_match("35", "3.5")
    assert answers_match("  blue   green red ", "blue green red")
    assert not answers_match("Blue green red", "blue green red")
    assert last_number("no digits") is None and last_number("-7 then 12.5") == 12.5
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "q", "a": "42"}])
    wl = dataset(
        path,
        fields={"input": "q", "answer": "a"},
        params={"match": "exact", "heldout_fraction": 0.0},
    )
    p = wl.problems("train", 1, 0)[0]
    assert wl.reward(p, {"planner": "p", "solver": "it is 42"})["solver"] == pytest.approx(0.1)
    assert wl.reward(p, {"planner": "", "solver": "42"}) == pytest.approx(
        {"planner": 0.9, "solver": 1.0}
    )


# -- callables --------------------------------------------------------------------------------

REWARDS = """
import math
def exact(problem, outputs):
    return outputs["solver"].strip() == problem.answer
def half(problem, outputs):
    return 0.5
def boom(problem, outputs):
    raise KeyError("nope")
def none(problem, outputs):
    return None
def nan(problem, outputs):
    return math.nan
def text(problem, outputs):
    return "1.0"
NOT_CALLABLE = 3
"""


def test_reward_callables_replace_scores(tmp_path: Path) -> None:
    mod = user_module(tmp_path, REWARDS)
    path = write_jsonl(tmp_path / "d.jsonl", rows())
    wl = dataset(
        path,
        base_dir=tmp_path,
        reward=f"{mod}:exact",
        credit="per_agent",
        agent_rewards={"planner": f"{mod}:half"},
        format_weight=0.0,
    )
    p = wl.problems("train", 1, 0)[0]
    assert wl.reward(p, {"solver": p.answer}) == {"planner": 0.5, "solver": 1.0}
    assert wl.reward(p, {"solver": f"{p.answer}!"}) == {"planner": 0.5, "solver": 0.0}
    assert wl.is_correct(p, {"solver": p.answer})
    partial = dataset(path, base_dir=tmp_path, reward=f"{mod}:half")
    assert not partial.is_correct(p, {"solver": p.answer})  # only full marks count as correct
    # File-path form, and pickling re-imports by name.
    ref = RewardCallable(f"{mod}.py:half", base_dir=tmp_path)
    assert pickle.loads(pickle.dumps(ref))(p, {}) == 0.5


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        ("boom", r"raised KeyError: 'nope' on sample input_id='q"),
        ("none", r"returned NoneType None on sample input_id='q"),
        ("nan", r"returned float nan on sample input_id='q"),
        ("text", r"returned str '1.0' on sample input_id='q"),
    ],
)
def test_bad_reward_callable_names_callable_and_sample(tmp_path: Path, fn: str, match: str) -> None:
    mod = user_module(tmp_path, REWARDS)
    wl = dataset(write_jsonl(tmp_path / "d.jsonl", rows()), base_dir=tmp_path, reward=f"{mod}:{fn}")
    p = wl.problems("train", 1, 0)[0]
    with pytest.raises(WorkloadError, match=match) as exc:
        wl.reward(p, {"solver": "1"})
    assert f"{mod}:{fn}" in str(exc.value) and "workload.reward" in str(exc.value)


def test_unimportable_callables_fail_at_build_time(tmp_path: Path) -> None:
    mod = user_module(tmp_path, REWARDS)
    broken = user_module(tmp_path, "import not_a_real_package_xyz\n")
    path = write_jsonl(tmp_path / "d.jsonl", rows())
    cases = [
        (
            {"reward": "no_such_module_xyz:score"},
            r"workload.reward: cannot import 'no_such_module_xyz:score'",
        ),
        ({"reward": f"{broken}:score"}, rf"cannot import '{broken}:score': ModuleNotFoundError"),
        ({"reward": f"{mod}:missing"}, rf"{mod}:missing'.*no attribute 'missing'"),
        ({"reward": f"{mod}:NOT_CALLABLE"}, r"is a int, not a callable"),
        ({"reward": "score"}, r"must look like 'module:function'"),
        (
            {"reward": "nowhere/r.py:score"},
            r"cannot import 'nowhere/r.py:score': FileNotFoundError",
        ),
        (
            {"credit": "per_agent", "agent_rewards": {"solver": "nope_xyz:f"}},
            r"workload.agent_rewards.solver: cannot import 'nope_xyz:f'",
        ),
        ({"credit": "per_agent", "agent_rewards": {"critic": f"{mod}:half"}}, "unknown agent"),
    ]
    for kw, match in cases:
        with pytest.raises(WorkloadError, match=match):
            dataset(path, base_dir=tmp_path, **kw)
    with pytest.raises(WorkloadError, match="no attribute"):
        load_callable("math:nope")


PROBLEMS = """
def make(n=3, answer="x"):
    for i in range(n):
        yield {"input": f"item {i}", "answer": answer, "split": "heldout" if i == 0 else "train",
               "meta": {"demo": {"planner": "think"}}, "extra": i}
def objects():
    from flexmarl_core.workloads import Problem
    return [Problem("p1", "a", "b", {"split": "train"}), Problem("p2", "c", "d", {"split": "heldout"})]
def boom(**kw):
    raise RuntimeError("generator broke")
def bad_item():
    return [{"input": "ok", "answer": "1"}, 42]
def no_answer():
    return [{"input": "ok"}]
def mixed():
    return [{"input": "pinned", "answer": "1", "split": "heldout"}] + [
        {"input": f"free {i}", "answer": "1"} for i in range(60)]
"""


def test_problem_callable(tmp_path: Path) -> None:
    mod = user_module(tmp_path, PROBLEMS)
    cfg = WorkloadConfig(
        kind="callable", callable=f"{mod}:make", params={"kwargs": {"n": 4, "answer": "y"}}
    )
    wl = make_workload(cfg, TEAM, base_dir=tmp_path)
    assert isinstance(wl, CallableWorkload)
    train = wl.problems("train", 3, 0)
    assert {p.input_id for p in train} == {"c1", "c2", "c3"} and train[0].answer == "y"
    assert wl.problems("heldout", 5, 0)[0].meta["extra"] == 0
    assert wl.demonstration(train[0], "planner", {}) == "think"
    assert wl.heldout_description(128) == (
        f"1 held-out problem from the problems of problem callable '{mod}:make' labelled "
        "held-out"
    )
    mixed = make_workload(WorkloadConfig(kind="callable", callable=f"{mod}:mixed"), TEAM, base_dir=tmp_path)
    n = len(mixed.problems("heldout", 99, 0))
    assert 1 < n < 61 and mixed.heldout_description(99) == (
        f"all {n} held-out problems: 1 from the problems of problem callable '{mod}:mixed' "
        f"labelled held-out, {n - 1} from a hash split (20%) of problem callable '{mod}:mixed'"
    )
    cfg = WorkloadConfig(kind="callable", callable=f"{mod}:objects")
    assert make_workload(cfg, TEAM, base_dir=tmp_path).problems("heldout", 5, 0)[0].input_id == "p2"


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (
            "boom",
            r"problem callable '{mod}:boom' \(workload.callable\) raised RuntimeError: generator broke",
        ),
        ("bad_item", r"problem callable '{mod}:bad_item' \(workload.callable\): item 1 is a int"),
        ("no_answer", r"problem callable '{mod}:no_answer' \(workload.callable\): item 0 needs"),
        ("missing", r"workload.callable: '{mod}:missing'"),
    ],
)
def test_bad_problem_callable_names_callable_and_item(tmp_path: Path, fn: str, match: str) -> None:
    mod = user_module(tmp_path, PROBLEMS)
    cfg = WorkloadConfig(kind="callable", callable=f"{mod}:{fn}")
    with pytest.raises(WorkloadError, match=match.format(mod=mod)):
        make_workload(cfg, TEAM, base_dir=tmp_path)


# -- GSM8K ------------------------------------------------------------------------------------


def test_gsm8k_answer_parsing() -> None:
    answer, rationale = gsm8k_answer("She sold 48/2 = <<48/2=24>>24.\nTotal 1,072.\n#### 1,072")  # type: ignore[misc]
    assert answer == "1072" and rationale == "She sold 48/2 = 24.\nTotal 1,072."
    assert gsm8k_answer("no final line") is None


def test_gsm8k_bad_rows_and_missing_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(
        tmp_path / "g.jsonl",
        [{"question": "q", "answer": "#### 3"}, {"question": "q2", "answer": "3"}],
    )
    with pytest.raises(
        WorkloadError, match=r"g.jsonl: line 2: GSM8K answer has no '#### <number>'"
    ):
        make_workload(WorkloadConfig(kind="gsm8k", path=str(path)), TEAM)
    monkeypatch.delenv("FLEXMARL_DATA", raising=False)
    with pytest.raises(WorkloadError, match="FLEXMARL_DATA"):
        make_workload(WorkloadConfig(kind="gsm8k"), TEAM)


def test_gsm8k_real_files(gsm8k_dir: Path) -> None:
    # kind: gsm8k without a path reads $FLEXMARL_DATA/gsm8k, the folder the fixture found
    wl = make_workload(WorkloadConfig(kind="gsm8k", credit="per_agent"), TEAM)
    pools = wl.pools()  # type: ignore[attr-defined]
    assert (len(pools["train"]), len(pools["heldout"])) == (7473, 1319)
    assert wl.heldout_description(128) == f"128 of 1319 held-out problems from {gsm8k_dir / 'test.jsonl'}"
    first = pools["train"][0]
    assert first.text.startswith("Natalia sold clips") and first.answer == "72"
    assert all(last_number(p.answer) is not None for p in pools["train"] + pools["heldout"])
    assert "<<" not in wl.demonstration(first, "planner", {}) and "24 clips" in wl.demonstration(
        first, "planner", {}
    )
    assert wl.demonstration(first, "solver", {}) == "72"
    r = wl.reward(first, {"planner": "half of 48", "solver": "She sold 72 clips."})
    assert r == {"planner": 1.0, "solver": 1.0}
    assert not wl.is_correct(first, {"solver": "71"})
    assert {p.text for p in wl.problems("heldout", 50, 0)}.isdisjoint(
        {p.text for p in pools["train"]}
    )


def test_example_gsm8k_config(gsm8k_dir: Path) -> None:
    # kind: gsm8k without a path reads $FLEXMARL_DATA/gsm8k, the folder the fixture found
    cfg = load_config(REPO / "configs" / "example_gsm8k.yaml")
    wl = make_workload(cfg.workload, cfg.team)
    p = wl.problems("heldout", 1, cfg.seed)[0]
    assert wl.is_correct(p, {"solver": wl.demonstration(p, "solver", {})})


# -- the example user-defined team ------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.yaml", "config_callable.yaml"])
def test_example_custom_team(name: str) -> None:
    cfg = load_config(REPO / "examples" / "custom_team" / name)
    wl = make_workload(cfg.workload, cfg.team, base_dir=REPO)
    meg = MEG.from_config(cfg.team)
    held = wl.problems("heldout", cfg.workload.heldout_size, cfg.seed)
    assert held and {p.text for p in held}.isdisjoint(
        {p.text for p in wl.problems("train", 100, cfg.seed)}
    )
    for p in held:
        outs: dict[str, str] = {}
        for agent in meg.agent_names:
            parents = {a: outs[a] for a in meg.agent_parents(agent)}
            meg.render_prompt(agent, p.text, parents)
            outs[agent] = wl.demonstration(p, agent, parents)
        assert wl.is_correct(p, outs) and set(wl.reward(p, outs).values()) == {1.0}
    p = held[0]
    words = p.answer.split()
    half = " ".join(words[:1] + ["zzz"] * (len(words) - 1))  # first word right only
    r = wl.reward(p, {"drafter": half, "checker": half})
    assert 0.1 < r["checker"] < 1.0 and not wl.is_correct(p, {"checker": half})


def test_core_workloads_import_no_prefect_or_dask() -> None:
    code = (
        "import sys, flexmarl_core.workloads\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('prefect', 'dask', 'distributed')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
