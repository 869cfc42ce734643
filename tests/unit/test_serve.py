"""`flexmarl serve`, run as a user runs it (the command in a process of its own): a trained run's
team, or its export, behind the OpenAI-compatible endpoint it trained through, answering the
real `openai` client on every route with the weights of flexmarl's own engines; a key where one
is set; never reachable from other machines without one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from flexmarl_core.config import SamplingConfig
from flexmarl_core.programs.chat import as_turns
from flexmarl_core.runtime.worker import context
from tests.unit.test_export import TURNS, _train

FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))
#: a start's bound: importing torch and loading three tiny models takes seconds; this only
#: guards against a server that never says it is up
START_S = 300


class Served:
    """`flexmarl serve ARGS` in a process of its own, up and answering; `base_url` from its line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([FLEXMARL, "serve", *args, "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        up = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("serving "):
                    up.set()
            up.set()  # it ended without serving

        threading.Thread(target=read, daemon=True).start()
        if not up.wait(START_S) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("flexmarl serve did not start:\n" + "".join(self.lines))
        line = next(x for x in self.lines if x.startswith("serving "))
        found = re.search(r" at (http://\S+/v1):", line)
        assert found, line
        self.base_url = found.group(1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # what Ctrl-C or a service manager sends
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("serve"), TURNS)


@pytest.fixture(scope="module")
def served(run):
    """`flexmarl serve RUN`, shared by the clients below; it stops as Ctrl-C stops it."""
    server = Served(str(run))
    yield server
    assert server.stop() == 0


def _greedy(run: Path, agent: str, prompt: str) -> str:
    """What flexmarl's own engine answers greedily at the agent's other sampling settings."""
    ctx = context(str(run))
    sampling = ctx.cfg.agent(agent).sampling.model_copy(update={"temperature": 0.0})
    return ctx.engine(agent, 2).generate([prompt], SamplingConfig(**sampling.model_dump()), 0)[0].text


#: the solver's user turn; with its system message ("Solve it.") what it was trained on
USER = "Q:3+4*2\nP:3+8\nA:"


def test_serve_a_run_answers_the_openai_client_with_its_engines_answers(run, served):
    ctx = context(str(run))
    plan_prompt = "Q:3+4*2\nP:"
    solver_prompt = as_turns(ctx.cfg.agent("solver"), USER)  # its system message and the user turn, chatml
    c = openai.OpenAI(base_url=served.base_url, api_key="anything on loopback", max_retries=0)
    assert sorted(m.id for m in c.models.list().data) == ["planner", "solver", "verifier"]
    got = c.completions.create(model="planner", prompt=plan_prompt, temperature=0)
    assert got.choices[0].text == _greedy(run, "planner", plan_prompt)
    msgs = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": USER}]
    chat = c.chat.completions.create(model="solver", messages=msgs, temperature=0)
    want = _greedy(run, "solver", solver_prompt)
    assert chat.choices[0].message.content == want
    assert chat.usage.prompt_tokens == len(ctx.engine("solver", 2).tokenizer.encode(solver_prompt))
    stream = c.chat.completions.create(model="solver", messages=msgs, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want
    resp = c.responses.create(model="solver", instructions="Solve it.", input=USER, temperature=0)
    assert resp.output_text == want
    with pytest.raises(openai.NotFoundError, match="nobody"):
        c.chat.completions.create(model="nobody", messages=msgs)


def test_serve_a_run_answers_langgraph_and_the_agents_sdk(run, served):
    """The frameworks users write teams in, pointed at the served run: LangGraph (a graph whose
    node is langchain-openai's ChatOpenAI, invoked and streamed) and the OpenAI Agents SDK on both
    of its model classes (Responses, Chat Completions) answer what the run's engine decodes."""
    import asyncio

    from agents import (
        Agent,
        ModelBehaviorError,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    want = _greedy(run, "solver", as_turns(context(str(run)).cfg.agent("solver"), USER))
    llm = ChatOpenAI(model="solver", base_url=served.base_url, api_key="anything", temperature=0, max_retries=0)

    def solve(state: MessagesState) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", END)
    messages = [("system", "Solve it."), ("user", USER)]
    assert graph.compile().invoke({"messages": messages})["messages"][-1].content == want
    assert "".join(str(chunk.content) for chunk in llm.stream(messages)) == want

    set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI's servers
    # The untrained tiny solver never ends before its max_new_tokens: the Responses API then says
    # `incomplete` (reason max_output_tokens), as OpenAI's does, and the SDK raises on that.
    ctx = context(str(run))
    sampling = ctx.cfg.agent("solver").sampling.model_copy(update={"temperature": 0.0})
    ended = ctx.engine("solver", 2).generate([as_turns(ctx.cfg.agent("solver"), USER)],
                                             SamplingConfig(**sampling.model_dump()), 0)[0].finish_reason

    async def sdk(model_class) -> str:
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="anything", max_retries=0)
        agent = Agent(name="solver", instructions="Solve it.", model=model_class("solver", client),
                      model_settings=ModelSettings(temperature=0))
        return str((await Runner.run(agent, USER)).final_output)

    assert asyncio.run(sdk(OpenAIChatCompletionsModel)) == want
    if ended == "length":
        with pytest.raises(ModelBehaviorError, match="max_output_tokens"):
            asyncio.run(sdk(OpenAIResponsesModel))
    else:
        assert asyncio.run(sdk(OpenAIResponsesModel)) == want
