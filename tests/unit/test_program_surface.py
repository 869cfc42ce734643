"""The rest of the OpenAI surface agent frameworks use, against flexmarl's real endpoint with
the real frameworks: streaming (LangGraph over langchain-openai with `streaming=True`, the
`openai` client's `stream=True` with usage), and the Responses API (the OpenAI Agents SDK on
its default model, `previous_response_id`). Each streamed or Responses program is captured
exactly as its chat twin: the same sample ids, prompt and response tokens, masks and logprobs.
The agents are scripted (`tests/_scripted.py`): what is checked is the mechanism."""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Literal

import openai
import pytest
import torch
from pydantic import BaseModel

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.hf import HFInferenceEngine
from flexmarl_core.programs.chat import BUILTIN
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from flexmarl_core.programs.runner import run_program
from tests._models_util import tiny_model, tokenizer
from tests._scripted import CALL, ScriptDispatcher, capture_rows, scripted_session


def _react_script(agent: str, prompt: str) -> str:
    return "The answer is 5." if "<tool_response>" in prompt else CALL


def _react(streaming: bool):
    def team(problem: str, client: openai.OpenAI) -> str:
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI
        from langgraph.prebuilt import create_react_agent

        @tool
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression."""
            return "5"

        llm = ChatOpenAI(model="solver", base_url=str(client.base_url), api_key=client.api_key, max_retries=0,
                         streaming=streaming)
        agent = create_react_agent(llm, [calculator])
        if not streaming:
            return agent.invoke({"messages": [("user", problem)]})["messages"][-1].content
        chunks = [m.content for m, _ in agent.stream({"messages": [("user", problem)]}, stream_mode="messages")
                  if m.type == "AIMessageChunk" and m.content]
        assert len(chunks) > 1, chunks  # token by token, not one blob
        return "".join(chunks)
    return team


def _same_capture(a, b) -> None:
    ra, rb = capture_rows(a), capture_rows(b)
    assert ra.keys() == rb.keys()
    for agent in ra:
        for x, y in zip(ra[agent], rb[agent], strict=True):
            for k in ("sample_id", "prompt_ids", "response_ids", "loss_mask", "logprobs", "extra"):
                assert x[k] == y[k], (agent, k)


def test_a_streaming_langgraph_react_agent_is_captured_as_the_same_agent_without_streaming():
    jobs = [("p0", 0, 0, "What is 2+3?")]
    (plain,) = run_program(_react(False), jobs, scripted_session(ScriptDispatcher(_react_script)), Gateway.shared())
    (streamed,) = run_program(_react(True), jobs, scripted_session(ScriptDispatcher(_react_script)), Gateway.shared())
    assert plain.error is None and streamed.error is None, (plain.error, streamed.error)
    assert plain.answer == streamed.answer == "The answer is 5."
    assert len(streamed.records) == 2  # the tool call streamed too, and was run
    _same_capture(plain, streamed)


def test_stream_chunks_join_to_the_answer_with_its_logprobs_and_usage():
    def team(problem: str, client: openai.OpenAI) -> str:
        msgs = [{"role": "user", "content": problem}]
        whole = client.chat.completions.create(model="solver", messages=msgs, logprobs=True, seed=7)
        parts = list(client.chat.completions.create(model="solver", messages=msgs, logprobs=True, seed=7,
                                                    stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        assert text == whole.choices[0].message.content
        lps = [lp.logprob for c in parts if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
        assert lps == [lp.logprob for lp in whole.choices[0].logprobs.content]
        assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in parts if c.choices][-1] == "stop"
        calls = list(client.chat.completions.create(model="solver", messages=msgs, stream=True, tools=[
            {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]))
        deltas = [tc for c in calls for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "calculator" and deltas[0].id.startswith("call_")
        assert "".join(d.function.arguments for d in deltas) == '{"expression": "2+3"}'
        assert calls[-1].choices[0].finish_reason == "tool_calls"
        done = client.completions.create(model="planner", prompt=problem, stream=True)
        return text + "|" + "".join(c.choices[0].text for c in done)

    def script(agent: str, prompt: str) -> str:
        return CALL if "# Tools" in prompt else "twelve words of answer"

    (res,) = run_program(team, [("p1", 0, 0, "2+3?")], scripted_session(ScriptDispatcher(script)), Gateway.shared())
    assert res.error is None and res.answer == "twelve words of answer|twelve words of answer", res.error


async def _agents_sdk(problem: str, client: openai.AsyncOpenAI) -> str:
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    set_tracing_disabled(True)
    set_default_openai_client(client, use_for_tracing=False)  # its default model: the Responses API

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return "5"

    return str((await Runner.run(Agent(name="s", instructions="Solve it.", model="solver", tools=[calculator]),
                                 problem)).final_output)


async def _agents_sdk_chat(problem: str, client: openai.AsyncOpenAI) -> str:
    from agents import set_default_openai_api

    set_default_openai_api("chat_completions")
    try:
        return await _agents_sdk(problem, client)
    finally:
        set_default_openai_api("responses")


def test_the_agents_sdk_on_its_default_responses_model_is_captured_as_on_chat_completions():
    jobs = [("p2", 0, 0, "What is 2+3?")]
    (resp,) = run_program(_agents_sdk, jobs, scripted_session(ScriptDispatcher(_react_script)), Gateway.shared())
    (chat,) = run_program(_agents_sdk_chat, jobs, scripted_session(ScriptDispatcher(_react_script)),
                          Gateway.shared())
    assert resp.error is None and chat.error is None, (resp.error, chat.error)
    assert resp.answer == chat.answer == "The answer is 5."
    (row,) = capture_rows(resp)["solver"]
    assert row["loss_mask"].count(0) > 0  # the tool's result, inserted and masked: one sample
    _same_capture(resp, chat)


def test_previous_response_id_continues_a_trajectorys_own_response_and_streams():
    seen: list[str] = []

    def script(agent: str, prompt: str) -> str:
        seen.append(prompt)
        return f"reply {len(seen)}"

    def team(problem: str, client: openai.OpenAI) -> str:
        first = client.responses.create(model="solver", instructions="Be brief.", input=problem)
        assert first.output_text == "reply 1" and first.status == "completed"
        events = list(client.responses.create(model="solver", instructions="Be brief.", input="and then?",
                                              previous_response_id=first.id, stream=True))
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text == "reply 2"
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="solver", input="x", previous_response_id="resp_elsewhere")
        assert err.value.code == "previous_response_not_found"
        return text

    (res,) = run_program(team, [("p3", 0, 0, "hello")], scripted_session(ScriptDispatcher(script)), Gateway.shared())
    assert res.error is None, res.error
    # The second call sees its instructions once (they are not carried over), the first
    # exchange, then its own input.
    assert seen[1].count("Be brief.") == 1 and "hello" in seen[1] and "reply 1" in seen[1] and "and then?" in seen[1]
    (row,) = capture_rows(res)["solver"]  # the second call continues the first: one sample
    assert row["extra"] == '{"calls": [0, 1]}'


def test_responses_refusals_say_what_to_do():
    def team(problem: str, client: openai.OpenAI) -> str:
        for kw, param in (({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"conversation": "conv_1"}, "conversation"),
                          ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]")):
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model="solver", **{"input": "x", **kw})
            assert err.value.param == param and len(err.value.message) < 300, err.value.message
        return "ok"

    (res,) = run_program(team, [("p4", 0, 0, "")], scripted_session(ScriptDispatcher(lambda a, p: "x")),
                         Gateway.shared())
    assert res.error is None, res.error


def test_async_streams_through_an_async_client():
    async def team(problem: str, client: openai.AsyncOpenAI) -> str:
        stream = await client.chat.completions.create(model="solver", messages=[{"role": "user", "content": problem}],
                                                      stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    (res,) = run_program(team, [("p5", 0, 0, "hi")], scripted_session(ScriptDispatcher(lambda a, p: "ok then")),
                         Gateway.shared())
    assert res.error is None and res.answer == "ok then", res.error
    assert asyncio.iscoroutinefunction(team)


# -- structured output: constrained decoding on the real (tiny, untrained) model -------------

class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def engine():
    return HFInferenceEngine(tiny_model(seed=3), tokenizer())


def _model_session(engine, max_tokens: int = 160) -> Session:
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_tokens)
    spec = AgentSpec("solver", sampling, BUILTIN["chatml"], tokenizer(), 4096)
    return Session("json", {"solver": spec}, {"solver": 0}, LocalDispatcher.of_engines({"solver": engine}),
                   lambda i, t, a, c: zlib.crc32(repr((i, t, a, c)).encode()) % 100_000)  # not hash(): salted per process


def test_with_structured_output_and_parse_get_json_of_the_schema_from_an_untrained_model(engine):
    """An untrained model writes the schema's JSON only because decoding allows nothing else:
    LangChain's `with_structured_output` (json_schema) and the openai client's `.parse()`."""
    def team(problem: str, client: openai.OpenAI) -> str:
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model="solver", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
        got = llm.with_structured_output(Verdict, method="json_schema").invoke(problem)
        parsed = client.chat.completions.parse(model="solver", messages=[{"role": "user", "content": problem}],
                                               response_format=Verdict).choices[0].message.parsed
        free = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": problem}],
                                              response_format={"type": "json_object"}, max_tokens=400)
        # any JSON object: an untrained model's string may run past max_tokens, else it parses
        choice = free.choices[0]
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
        return f"{got.answer}|{parsed.answer}"

    jobs = [(f"p{k}", k, 0, "Is 2+2 four?") for k in range(4)]
    results = run_program(team, jobs, _model_session(engine), Gateway.shared())
    for res in results:
        assert res.error is None, res.error
        assert all(a in ("yes", "no") for a in res.answer.split("|"))


def test_constrained_logprobs_are_the_sampled_distributions(engine):
    """The behaviour log-prob of each token is the model's, renormalised over the tokens the
    schema allowed at that step (recomputed here with a fresh enforcer, one forward pass)."""
    from flexmarl_core.inference.constrained import RowConstraints

    schema = Verdict.model_json_schema()

    def team(problem: str, client: openai.OpenAI) -> str:
        r = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": problem}],
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "v", "schema": schema}})
        return r.choices[0].message.content or ""

    (res,) = run_program(team, [("p9", 0, 0, "Is 3 odd?")], _model_session(engine), Gateway.shared())
    assert res.error is None, res.error
    Verdict.model_validate_json(res.answer)
    (rec,) = res.records
    ids, resp = rec.prompt_ids, rec.gen.response_ids
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([ids + resp])).logits[0, len(ids) - 1 : -1].float()
    check = RowConstraints(engine.tokenizer, engine.eos_ids, [schema], [ids])
    want = []
    for k, tok in enumerate(resp):
        row = logits[k : k + 1].clone()
        check.apply(row, torch.tensor([0]), torch.tensor([resp]), torch.tensor([k]), torch.tensor([False]))
        want.append(float(torch.log_softmax(row[0], -1)[tok]))
    # fp32 logits of O(10): a batched and a single forward differ by a few ulps
    assert rec.gen.logprobs == pytest.approx(want, abs=1e-4)
    free = torch.log_softmax(logits, -1).gather(1, torch.tensor(resp)[:, None])[:, 0].tolist()
    assert sum(want) > sum(free)  # the constraint moved probability onto what was sampled


def test_plain_template_on_a_chat_of_several_roles_warns_once_naming_the_fix(caplog):
    from flexmarl_core.programs import calls

    calls._PLAIN_WARNED.discard("solver")

    def team(problem: str, client: openai.OpenAI) -> str:
        msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": problem}]
        for _ in range(2):
            client.chat.completions.create(model="solver", messages=msgs)
        return client.chat.completions.create(model="solver", messages=msgs[1:]).choices[0].message.content or ""

    with caplog.at_level("WARNING", logger="flexmarl_core.programs.calls"):
        (res,) = run_program(team, [("p6", 0, 0, "hi")],
                             scripted_session(ScriptDispatcher(lambda a, p: "ok"), template="plain"), Gateway.shared())
    assert res.error is None, res.error
    said = [r.getMessage() for r in caplog.records if "chat_template 'plain'" in r.getMessage()]
    assert len(said) == 1 and "system/user" in said[0] and "team.agents.solver.chat_template" in said[0]
