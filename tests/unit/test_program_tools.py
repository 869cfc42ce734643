"""Agent programs as people write them, with tools, against flexmarl's real endpoint: a
LangGraph prebuilt ReAct agent with a tool and an OpenAI Agents SDK handoff, their capture
checked row by row (masks, continuation, ids, tool results masked); calls made at once are
recorded the same whatever order they arrive in; a process-global client is recorded right,
and a client shared around the one each trajectory is given is refused; a huge body never
holds the event loop.

The agents here are scripted (`ScriptDispatcher`: each call is answered with the text a rule
gives for its prompt, as tokens ending in EOS), so what is checked is the mechanism, never
what a model happened to write. The tiny model decodes where sampling itself is the point.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import openai
import pytest

from flexmarl_core.inference.hf import HFInferenceEngine
from flexmarl_core.programs.api import ProgramError
from flexmarl_core.programs.chat import BUILTIN
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from flexmarl_core.programs.runner import run_program
from tests._models_util import tiny_model, tokenizer
from tests._scripted import CALL, SAMPLING, ScriptDispatcher, capture_rows, scripted_session


def _react(problem: str, client: openai.OpenAI) -> str:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression, {"__builtins__": {}}))  # the test's own fixed expression

    llm = ChatOpenAI(model="solver", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    out = create_react_agent(llm, [calculator]).invoke({"messages": [("user", problem)]})
    return out["messages"][-1].content


def test_a_langgraph_react_agent_calls_its_tool_and_the_loop_is_one_sample():
    def script(agent: str, prompt: str) -> str:
        return "The answer is 5." if "<tool_response>" in prompt else CALL

    (res,) = run_program(_react, [("p0", 0, 0, "What is 2+3?")], scripted_session(ScriptDispatcher(script)), Gateway.shared())
    assert res.error is None and res.answer == "The answer is 5.", res.error
    first, second = sorted(res.records, key=lambda r: r.call)
    assert "# Tools" in first.prompt_text and '"name": "calculator"' in first.prompt_text  # the tools, rendered
    assert second.prompt_text.endswith("<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    (row,) = capture_rows(res)["solver"]
    tok = tokenizer()
    n1, n2 = len(first.gen.response_ids), len(second.gen.response_ids)
    inserted = second.prompt_ids[len(first.prompt_ids) + n1:]
    # One sample: the call, the tool's result inserted (masked, log-prob 0), the answer.
    assert row["prompt_ids"] == first.prompt_ids
    assert row["response_ids"] == first.gen.response_ids + inserted + second.gen.response_ids
    assert row["loss_mask"] == [1] * n1 + [0] * len(inserted) + [1] * n2
    assert row["logprobs"] == [-0.25] * n1 + [0.0] * len(inserted) + [-0.25] * n2
    assert tok.decode(first.gen.response_ids[:-1]) == CALL  # the sampled ids, exactly as sampled
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(inserted)
    assert json.loads(row["extra"]) == {"calls": [0, 1]}


async def _handoff(problem: str, client: openai.AsyncOpenAI) -> str:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    solver = Agent(name="solver_agent", instructions="Solve it.",
                   model=OpenAIChatCompletionsModel(model="solver", openai_client=client))
    triage = Agent(name="triage", instructions="Hand arithmetic to the solver.", handoffs=[solver],
                   model=OpenAIChatCompletionsModel(model="planner", openai_client=client))
    return str((await Runner.run(triage, problem)).final_output)


def test_an_agents_sdk_handoff_is_a_tool_call_and_each_agent_records_its_own_sample():
    def script(agent: str, prompt: str) -> str:
        if agent == "planner":
            return '<tool_call>\n{"name": "transfer_to_solver_agent", "arguments": {}}\n</tool_call>'
        return "42"

    (res,) = run_program(_handoff, [("p1", 0, 0, "What is 6*7?")], scripted_session(ScriptDispatcher(script)),
                         Gateway.shared())
    assert res.error is None and res.answer == "42", res.error
    rows = capture_rows(res)
    (plan,), (solve,) = rows["planner"], rows["solver"]
    assert '"name": "transfer_to_solver_agent"' in plan["prompt_text"]  # the handoff, offered as a tool
    assert plan["response_text"].startswith("<tool_call>") and plan["loss_mask"] is None
    # The solver sees the triage's call and its result, as the SDK sends them, and answers.
    assert "transfer_to_solver_agent" in solve["prompt_text"] and "<tool_response>" in solve["prompt_text"]
    assert solve["response_text"] == "42" and solve["parents"] == [plan["sample_id"]]


def test_tool_choice_required_starts_the_answer_with_a_call_and_none_parses_nothing():
    seen: list[str] = []

    def script(agent: str, prompt: str) -> str:
        seen.append(prompt)
        return '"calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

    def team(problem: str, client: openai.OpenAI) -> str:
        msgs = [{"role": "user", "content": problem}]
        forced = client.chat.completions.create(model="solver", messages=msgs, tools=tools, tool_choice="required")
        free = client.chat.completions.create(model="solver", messages=msgs, tools=tools, tool_choice="none")
        (call,) = forced.choices[0].message.tool_calls
        assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "1+1"}
        assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "stop"
        return "ok"

    (res,) = run_program(team, [("p2", 0, 0, "1+1?")], scripted_session(ScriptDispatcher(script)), Gateway.shared())
    assert res.error is None, res.error
    assert seen[0].endswith('<|im_start|>assistant\n<tool_call>\n{"name": ')  # the call's start, forced
    assert not seen[1].endswith("{\"name\": ")


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>',  # bad JSON
    '<tool_call>\n{"name": "search", "arguments": {"q": "2+3"}}\n</tool_call>',  # not offered
], ids=["malformed", "not-offered"])
def test_a_malformed_call_comes_back_as_text_and_ending_on_it_is_the_policys_failure(bad: str):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

    def team(problem: str, client: openai.OpenAI) -> str:
        r = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": problem}], tools=tools)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        if problem == "again":  # the program asks once more and gets a plain answer
            r = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "plain"}], tools=tools)
        return r.choices[0].message.content or ""

    script = ScriptDispatcher(lambda a, p: "42" if "plain" in p else bad)
    ended, recovered = run_program(team, [("p3", 0, 0, "?"), ("p4", 0, 0, "again")], scripted_session(script),
                                   Gateway.shared())
    assert ended.answer == bad and ended.policy_error == "MalformedToolCall" and "MalformedToolCall" in ended.error
    assert recovered.error is None and recovered.policy_error is None and recovered.answer == "42"


@pytest.fixture(scope="module")
def engines():
    return {a: HFInferenceEngine(tiny_model(seed=i), tokenizer()) for i, a in enumerate(["planner", "solver"])}


def _fan_out(order: Sequence[int]) -> Callable:
    async def team(problem: str, client: openai.AsyncOpenAI) -> str:
        async def ask(k: int) -> str:
            r = await client.chat.completions.create(model="solver", max_tokens=6,
                                                     messages=[{"role": "user", "content": f"{problem} part {k}:"}])
            return r.choices[0].message.content or ""
        got = await asyncio.gather(*(ask(k) for k in order))
        return "|".join(sorted(got))
    return team


def test_calls_made_at_once_get_the_same_ids_and_tokens_whatever_order_they_arrive_in(engines):
    def run(order: Sequence[int]) -> dict[str, list[int]]:
        s = Session("fan", {a: AgentSpec(a, SAMPLING, BUILTIN["plain"], tokenizer(), 2048) for a in engines},
                    dict.fromkeys(engines, 0), LocalDispatcher.of_engines(engines),
                    lambda i, t, a, c: hash((i, t, a, c)) % 100_000)
        res = run_program(_fan_out(order), [("p4", 0, 0, "Q:7*6"), ("p4", 1, 0, "Q:7*6")], s, Gateway.shared())
        rows = {}
        for r in res:
            for row in capture_rows(r)["solver"]:
                rows[row["sample_id"]] = (row["prompt_text"], row["response_ids"])
        return rows

    forward, backward = run([0, 1, 2]), run([2, 1, 0])
    assert len(forward) == 6 and forward == backward  # the same calls under the same ids, token for token
    # the k-th call of the agent is the same call in every trajectory (a GRPO group of like calls)
    assert {forward[f"p4:0:solver:{k}"][0] for k in range(3)} == {forward[f"p4:1:solver:{k}"][0] for k in range(3)}
    assert all(forward[f"p4:0:solver:{k}"][0] == forward[f"p4:1:solver:{k}"][0] for k in range(3))


async def _global(problem: str, client: openai.AsyncOpenAI) -> str:
    from agents import (
        Agent,
        Runner,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    set_default_openai_api("chat_completions")
    set_default_openai_client(client, use_for_tracing=False)  # process-global: the last setter wins
    await asyncio.sleep(0.05)  # every trajectory has set it before any calls
    out = await Runner.run(Agent(name="s", instructions="Answer.", model="solver"), problem)
    return str(out.final_output)


def test_a_process_global_client_is_recorded_under_the_trajectory_that_calls():
    (res_a, res_b, res_c) = run_program(
        _global, [("pa", 0, 0, "alpha?"), ("pb", 0, 0, "bravo?"), ("pc", 0, 0, "charlie?")],
        s := scripted_session(ScriptDispatcher(lambda a, p: p.rsplit("\n", 3)[-3] + " done")), Gateway.shared())
    for res, word in ((res_a, "alpha"), (res_b, "bravo"), (res_c, "charlie")):
        assert res.error is None, res.error
        (rec,) = res.records
        assert word in rec.prompt_text and res.answer.startswith(word), (word, rec.prompt_text)
    assert sum(t.rerouted for t in s.trajectories.values()) >= 2  # two went through another's client


_SHARED: list[openai.OpenAI] = []


def _module_client(problem: str, client: openai.OpenAI) -> str:
    if not _SHARED:  # built once, from the first trajectory's settings, as module-level code would
        _SHARED.append(openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0))
    barrier.wait()  # every trajectory is running before any calls, so none has ended
    r = _SHARED[0].chat.completions.create(model="solver", messages=[{"role": "user", "content": problem}])
    return r.choices[0].message.content or ""


barrier = threading.Barrier(3)


def test_a_client_shared_around_the_given_one_is_refused_naming_the_fix():
    _SHARED.clear()
    with pytest.raises(ProgramError, match="Use the client the program function receives"):
        run_program(_module_client, [("pa", 0, 0, "a"), ("pb", 0, 0, "b"), ("pc", 0, 0, "c")],
                    scripted_session(ScriptDispatcher(lambda a, p: "x")), Gateway.shared())


class _CountingTokenizer:
    """The real tokenizer, with a count of the texts it encoded and the threads that did."""

    def __init__(self, tok) -> None:
        self._tok, self.encoded, self.threads = tok, [], set()

    def encode(self, text, **kw):
        self.encoded.append(len(text))
        self.threads.add(threading.current_thread().name)
        return self._tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)

    def __deepcopy__(self, memo):
        return self


def test_a_huge_body_is_refused_before_it_is_tokenized_and_tokenizing_is_off_the_event_loop():
    spy = _CountingTokenizer(tokenizer())
    specs = {"solver": AgentSpec("solver", SAMPLING, BUILTIN["plain"], spy, 2048)}
    s = Session("big", specs, {"solver": 0}, ScriptDispatcher(lambda a, p: "ok"), lambda *a: 0)

    def team(problem: str, client: openai.OpenAI) -> str:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "x" * 1_000_000}])
        assert err.value.code == "context_length_exceeded" and "send a shorter prompt" in str(err.value)
        r = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "small"}])
        return r.choices[0].message.content or ""

    (res,) = run_program(team, [("p5", 0, 0, "")], s, Gateway.shared())
    assert res.error is None and res.answer == "ok", res.error
    assert spy.encoded == [len("small")]  # the huge one never reached the tokenizer
    assert spy.threads and all(n.startswith("flexmarl-prep") for n in spy.threads)


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _demos(config: str):
    from flexmarl_core.config import load_config
    from flexmarl_core.programs.team import program_team
    from flexmarl_core.workloads import make_workload

    cfg = load_config(str(CONFIGS / config), ["workload.heldout_size=8"])
    wl = make_workload(cfg.workload, cfg.team)
    problems = wl.problems("train", 4, seed=1)
    team = program_team(cfg.team, cfg.seed)
    return problems, team, team.demonstrations(wl, problems, seed=0, perturb=0.0)


def test_sft_of_a_react_program_demonstrates_each_tool_call_and_the_answer_in_the_agents_format():
    """configs/program_react.yaml: LangGraph's ReAct agent run against the demonstrations calls
    `calculator` once per operation (the hermes format, the right reduction) and then answers;
    each turn's prompt holds the tool results before it, so every turn is its own SFT pair.
    Its problems read in words (`12 times 34`); the calls are in symbols."""
    problems, team, demos = _demos("program_react.yaml")
    tok = team.agents["solver"].tokenizer
    by_prompt = {p.text: p for p in problems}
    per_problem: dict[str, list[tuple[str, str]]] = {}
    for ids, target in demos["solver"]:
        prompt = tok.decode(ids, skip_special_tokens=False)
        (text,) = [t for t in by_prompt if f"Compute {t}" in prompt]
        per_problem.setdefault(text, []).append((prompt, target))
    assert set(per_problem) == set(by_prompt)
    for text, pairs in per_problem.items():
        assert any(w in text for w in (" plus ", " minus ", " times "))
        steps = by_prompt[text].meta["steps"]
        pairs.sort(key=lambda pt: len(pt[0]))  # each turn's prompt extends the one before
        assert len(pairs) == len(steps) + 1
        for k, (op, value, _) in enumerate(steps):
            prompt, target = pairs[k]
            assert json.loads(target.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
                "name": "calculator", "arguments": {"expression": op}}
            assert pairs[k + 1][0].startswith(prompt.rsplit("<|im_start|>assistant", 1)[0])
            assert str(value) in pairs[k + 1][0]  # the tool's result is in the next turn's prompt
        assert pairs[-1][1] == by_prompt[text].answer


def test_sft_of_an_agents_sdk_handoff_demonstrates_the_transfer_and_the_solvers_answer():
    """configs/program_handoff.yaml: the triage agent's demonstrated first turn is the Agents
    SDK's `transfer_to_solver` call, the SDK then hands the conversation to the solver, whose
    pair is the answer."""
    problems, team, demos = _demos("program_handoff.yaml")
    calls = [json.loads(t.removeprefix("<tool_call>").removesuffix("</tool_call>")) for _, t in demos["planner"]]
    assert calls == [{"name": "transfer_to_solver", "arguments": {}}] * len(problems)
    tok = team.agents["solver"].tokenizer
    answers = sorted(t for _, t in demos["solver"])
    assert answers == sorted(p.answer for p in problems)
    assert all("transfer_to_solver" in tok.decode(ids) for ids, _ in demos["solver"])


def test_sft_says_when_a_demonstration_is_longer_than_the_agents_answers_may_be():
    """A hermes call is ~60 tokens of the tiny tokenizer: at max_new_tokens=48 every sampled call
    would be cut mid-JSON and never parse, which SFT says once, naming the agent and the field."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.sft import _warn_cut

    _, team, demos = _demos("program_react.yaml")
    toks = {"solver": team.agents["solver"].tokenizer}
    cfg = load_config(str(CONFIGS / "program_react.yaml"), ["team.agents.solver.sampling.max_new_tokens=48"])
    said: list[str] = []
    _warn_cut(cfg, demos, toks, said.append)
    assert len(said) == 1 and "team.agents.solver.sampling.max_new_tokens=48" in said[0]
    _warn_cut(load_config(str(CONFIGS / "program_react.yaml")), demos, toks, said.append)
    assert len(said) == 1  # the shipped config fits its calls
