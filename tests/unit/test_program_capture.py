"""A program's calls become MEG Store rows: exact continuations merge into one multi-turn sample
with the inserted tokens masked, anything else is a sample of its own; programs load by
`module:function` or `path.py:function`, run sync or async, and a trajectory whose program
fails is named and left out, unless every trajectory fails."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import openai
import pytest

from flexmarl_core.config import ConfigError, SamplingConfig, load_config
from flexmarl_core.inference.api import Generation
from flexmarl_core.inference.hf import HFInferenceEngine
from flexmarl_core.programs.api import CallRecord, ProgramError, TrajectoryResult
from flexmarl_core.programs.capture import merge_calls, trajectory_rows
from flexmarl_core.programs.chat import BUILTIN
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from flexmarl_core.programs.runner import check_failures, load_program, run_program
from tests._models_util import tiny_model, tokenizer

REPO = Path(__file__).resolve().parents[2]

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6, stop=["\n"])


def _rec(agent: str, call: int, prompt: list[int], resp: list[int], version: int = 0,
         after: tuple[int, ...] = ()) -> CallRecord:
    g = Generation(prompt_ids=prompt, response_ids=resp, text=f"<{resp}>", logprobs=[-0.5] * len(resp),
                   finish_reason="stop", version=version)
    return CallRecord(agent, call, prompt, f"[{prompt}]", g, 0.0, 0.0, after)


def _decode(agent: str, ids: list[int]) -> str:
    return f"({ids})"


def test_an_exact_continuation_merges_with_the_inserted_tokens_masked():
    records = [
        _rec("solver", 0, [1, 2], [3, 4]),
        _rec("solver", 1, [1, 2, 3, 4, 9, 9], [5]),  # continues call 0 (9, 9 inserted)
        _rec("solver", 2, [1, 2, 3, 7], [6]),  # does not continue (3, 7 != 3, 4)
        _rec("critic", 0, [1, 2, 3, 4], [8]),  # another agent never continues solver's
        _rec("solver", 3, [1, 2, 3, 4, 9, 9, 5, 0], [6], version=1),  # another version: its own
    ]
    samples = merge_calls(records, _decode)
    solver = [s for s in samples if s.agent == "solver"]
    assert [(s.turn, s.calls) for s in solver] == [(0, [0, 1]), (2, [2]), (3, [3])]
    merged = solver[0]
    assert merged.prompt_ids == [1, 2] and merged.response_ids == [3, 4, 9, 9, 5]
    assert merged.mask == [1, 1, 0, 0, 1] and merged.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert "".join(merged.texts) == "<[3, 4]>([9, 9])<[5]>"


def test_rows_carry_ids_turns_parents_and_calls():
    res = TrajectoryResult("p7", 3, 1, "42", None, [
        _rec("planner", 0, [1], [2]),
        _rec("solver", 0, [1, 2], [3], after=(0,)),
        _rec("solver", 1, [1, 2, 3, 5], [4], after=(0, 1)),
    ])
    rows = trajectory_rows(res, _decode)
    (plan,), (sol,) = rows["planner"], rows["solver"]
    assert plan["sample_id"] == "p7:3:planner:0" and plan["parents"] == [] and plan["loss_mask"] is None
    assert sol["sample_id"] == "p7:3:solver:0" and sol["parents"] == ["p7:3:planner:0"]
    assert sol["response_ids"] == [3, 5, 4] and sol["loss_mask"] == [1, 0, 1] and sol["mb"] == 1
    assert sol["extra"] == '{"calls": [0, 1]}'


@pytest.fixture(scope="module")
def session_factory():
    engines = {a: HFInferenceEngine(tiny_model(seed=i), tokenizer()) for i, a in enumerate(["solver", "verifier"])}
    specs = {a: AgentSpec(a, SAMPLING, BUILTIN["plain"], tokenizer(), 2048) for a in engines}
    return lambda: Session("k", specs, {a: 0 for a in engines}, LocalDispatcher.of_engines(engines),
                           lambda i, t, a, c: 7 * t + int(c.split(":")[1]))


def test_a_multi_turn_program_through_the_endpoint_becomes_one_sample(session_factory):
    """A tool-style loop: the program sends back the prompt and the response's token ids plus
    a tool result; the two calls are one sample whose tool tokens are masked."""
    tok = tokenizer()
    s = session_factory()

    def team(problem: str, client: openai.OpenAI) -> str:
        prompt = tok.encode(f"Q:{problem}\nA:", add_special_tokens=False)
        client.completions.create(model="solver", prompt=prompt, max_tokens=3)
        got = next(iter(s.trajectories.values())).records[-1].gen.response_ids  # the ids it sampled
        tool = tok.encode("=7;", add_special_tokens=False)
        r2 = client.completions.create(model="solver", prompt=prompt + got + tool, max_tokens=3)
        return r2.choices[0].text

    (res,) = run_program(team, [("p0", 0, 0, "3+4")], s, Gateway.shared())
    assert res.error is None, res.error
    first, second = res.records
    (row,) = trajectory_rows(res, lambda a, ids: tok.decode(ids))["solver"]
    tool_ids = tok.encode("=7;", add_special_tokens=False)
    n1, n2 = len(first.gen.response_ids), len(second.gen.response_ids)
    assert row["response_ids"] == first.gen.response_ids + tool_ids + second.gen.response_ids
    assert row["loss_mask"] == [1] * n1 + [0] * len(tool_ids) + [1] * n2
    assert row["logprobs"][n1:n1 + len(tool_ids)] == [0.0] * len(tool_ids)


def test_failing_trajectories_are_named_and_all_failing_is_an_error(session_factory):
    def team(problem: str, client: openai.OpenAI) -> str:
        if problem == "bad":
            raise ValueError("cannot parse")
        if problem == "none":
            return None  # type: ignore[return-value]
        return client.chat.completions.create(model="verifier", messages=[{"role": "user", "content": problem}]
                                              ).choices[0].message.content or ""

    jobs = [("a", 0, 0, "1+1"), ("b", 0, 0, "bad"), ("c", 1, 0, "none")]
    res = run_program(team, jobs, session_factory(), Gateway.shared())
    assert res[0].error is None and isinstance(res[0].answer, str) and len(res[0].records) == 1
    assert res[1].error.startswith("ValueError: cannot parse") and "test_program_capture.py" in res[1].error
    assert res[2].error.startswith("TypeError") and "NoneType" in res[2].error
    check_failures("m:team", res, "program it=0 mb=0")  # one trajectory answered: the op goes on
    res = run_program(team, [("b", 0, 0, "bad"), ("b", 1, 0, "bad")], session_factory(), Gateway.shared())
    with pytest.raises(ProgramError, match=r"program it=0 mb=0: every trajectory .* input b trajectory 0: ValueError"):
        check_failures("m:team", res, "program it=0 mb=0")


def test_an_async_program_runs_concurrently_on_one_loop(session_factory):
    async def team(problem: str, client: openai.AsyncOpenAI) -> str:
        a, b = await asyncio.gather(*(client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": problem}], temperature=0) for m in ("solver", "verifier")))
        return (a.choices[0].message.content or "") + (b.choices[0].message.content or "")

    s = session_factory()
    res = run_program(team, [("p", k, 0, "2*3") for k in range(4)], s, Gateway.shared())
    assert all(r.error is None for r in res) and len({r.answer for r in res}) == 1
    assert sorted(r.agent for r in res[0].records) == ["solver", "verifier"]
    assert sum(n for _, n, _, _ in s.decodes) == 8


def test_programs_load_by_module_or_path_with_clear_errors(tmp_path):
    assert load_program("examples.programs.arith_team:team").__name__ == "team"
    assert load_program(f"{REPO}/examples/programs/arith_team.py:team").__name__ == "team"
    (tmp_path / "two.py").write_text("def one(problem):\n    return problem\n")
    with pytest.raises(ProgramError, match=r"must take \(problem, client\); it takes \['problem'\]"):
        load_program(f"{tmp_path}/two.py:one")
    with pytest.raises(ProgramError, match="has no function 'nope'"):
        load_program(f"{tmp_path}/two.py:nope")
    with pytest.raises(ProgramError, match="no file"):
        load_program(f"{tmp_path}/missing.py:team")
    with pytest.raises(ProgramError, match="cannot load 'no_such_module_x'"):
        load_program("no_such_module_x:team")


def test_program_team_config_errors_name_the_field(tmp_path):
    cfg = REPO / "configs" / "program_team.yaml"
    with pytest.raises(ConfigError, match=r"team.program.*no file"):
        load_config(cfg, overrides=[f"team.program={tmp_path}/missing.py:team"])
    with pytest.raises(ConfigError, match="remove team.edges"):
        load_config(cfg, overrides=["team.edges=[planner -> solver]"])
    with pytest.raises(ConfigError, match=r"chat_template.*does not compile"):
        load_config(cfg, overrides=["team.agents.solver.chat_template='{% for %}'"])
    with pytest.raises(ConfigError, match=r"agent 'planner' has no template"):
        load_config(REPO / "configs" / "default.yaml", overrides=["team.agents.planner.template=null"])
    ok = load_config(cfg)
    assert ok.team.program.endswith("examples/programs/arith_team.py:team") and ok.team.program.startswith("/")


def test_a_program_loaded_by_several_threads_at_once_is_whole_in_each(tmp_path):
    """Two program ops of one process load the program together (the ThreadExecutor, a Dask
    worker's threads): each gets the function, never the module half-run by the other. The
    module sleeps before defining it, so an unguarded second load would find no function."""
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(0.2)\n\ndef team(problem, client):\n    return problem\n")
    got: list[object] = []

    def load() -> None:
        try:
            got.append(load_program(f"{tmp_path}/slow.py:team").__name__)
        except ProgramError as exc:
            got.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert got == ["team"] * 4


def test_a_program_that_fails_to_load_is_not_left_half_loaded(tmp_path):
    bad = tmp_path / "flaky.py"
    bad.write_text("raise RuntimeError('not yet')\n")
    with pytest.raises(ProgramError, match="not yet"):
        load_program(f"{bad}:team")
    bad.write_text("def team(problem, client):\n    return problem\n")
    assert load_program(f"{bad}:team").__name__ == "team"


def test_the_langgraph_example_runs_unchanged():
    """`examples/programs/langgraph_team.py` (LangGraph over langchain-openai's ChatOpenAI, no
    flexmarl import) through the endpoint: every trajectory calls planner, solver, verifier in
    order, its answer is the verifier's text, and the rows come out as for a plain program."""
    pytest.importorskip("langgraph", reason="the dev extra installs langgraph")
    agents = ["planner", "solver", "verifier"]
    engines = {a: HFInferenceEngine(tiny_model(seed=i), tokenizer()) for i, a in enumerate(agents)}
    specs = {a: AgentSpec(a, SAMPLING, BUILTIN["plain"], tokenizer(), 2048) for a in engines}
    s = Session("k", specs, dict.fromkeys(engines, 0), LocalDispatcher.of_engines(engines), lambda i, t, a, c: 7 * t + int(c.split(":")[1]))
    team = load_program(f"{REPO}/examples/programs/langgraph_team.py:team")
    res = run_program(team, [(f"p{k // 2}", k % 2, 0, f"{k}+1*2") for k in range(6)], s, Gateway.shared())
    assert [r.error for r in res] == [None] * 6
    for r in res:
        assert [c.agent for c in r.records] == agents
        assert r.answer == r.records[-1].gen.text
        assert set(trajectory_rows(r, tokenizer().decode)) == set(agents)


def test_the_mixture_of_agents_example_discovers_its_edges():
    """`examples/programs/moa_team.py` calls its proposers from three threads at once, then the
    aggregator: every trajectory stores one sample per agent, and the aggregator's parents are
    exactly that trajectory's three proposer samples (the edges the program took)."""
    agents = ["p1", "p2", "p3", "aggregator"]
    engines = {a: HFInferenceEngine(tiny_model(seed=i), tokenizer()) for i, a in enumerate(agents)}
    specs = {a: AgentSpec(a, SAMPLING, BUILTIN["plain"], tokenizer(), 2048) for a in engines}
    s = Session("k", specs, dict.fromkeys(engines, 0), LocalDispatcher.of_engines(engines), lambda i, t, a, c: 7 * t + int(c.split(":")[1]))
    team = load_program(f"{REPO}/examples/programs/moa_team.py:team")
    results = run_program(team, [("p0", t, 0, "3+4*2") for t in range(2)], s, Gateway.shared())
    tok = tokenizer()
    for res in results:
        assert res.error is None, res.error
        rows = trajectory_rows(res, lambda a, ids: tok.decode(ids))
        assert sorted(rows) == sorted(agents) and all(len(r) == 1 for r in rows.values())
        (agg,) = rows["aggregator"]
        assert agg["parents"] == sorted(f"p0:{res.traj}:{p}:0" for p in ("p1", "p2", "p3"))
        for i, p in enumerate(("p1", "p2", "p3"), 1):
            assert f"{i}:{rows[p][0]['response_text'].strip()}" in agg["prompt_text"]
