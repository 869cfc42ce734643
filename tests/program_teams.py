"""Team programs for tests (imported by name, also inside Dask workers): plain functions of
(problem, client), as users write them."""

from __future__ import annotations

from openai import OpenAI


def _ask(client: OpenAI, agent: str, prompt: str) -> str:
    r = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": prompt}])
    return r.choices[0].message.content or ""


def half_fail(problem: str, client: OpenAI) -> str:
    """The default team, except that a problem whose first digit is odd makes it raise after
    its planner call (a bug of the program's own, not of flexmarl)."""
    plan = _ask(client, "planner", f"Q:{problem}\nP:")
    if int(next(c for c in problem if c.isdigit())) % 2:
        raise ValueError(f"cannot handle {problem!r}")
    answer = _ask(client, "solver", f"Q:{problem}\nP:{plan}\nA:")
    return _ask(client, "verifier", f"Q:{problem}\nA:{answer}\nV:")


def always_fail(problem: str, client: OpenAI) -> str:
    _ask(client, "planner", f"Q:{problem}\nP:")
    raise RuntimeError("this program is broken")


def json_plan(problem: str, client: OpenAI) -> str:
    """The planner must answer a JSON object: anything else is the policy's failure (a
    `JSONDecodeError`, or flexmarl's `PolicyFailure` for JSON that is no object)."""
    import json

    from flexmarl_core.programs.api import PolicyFailure

    plan = json.loads(_ask(client, "planner", f"Q:{problem}\nP:"))
    if not isinstance(plan, dict):
        raise PolicyFailure(f"the plan is {type(plan).__name__}, not an object")
    return _ask(client, "solver", f"Q:{problem}\nP:{plan}\nA:")


def type_error(problem: str, client: OpenAI) -> str:
    """A bug of the program's own after a call: dropped, whatever the policy said."""
    _ask(client, "planner", f"Q:{problem}\nP:")
    return len(problem) + "x"  # type: ignore[operator]


def langgraph_until_done(problem: str, client: OpenAI) -> str:
    """A LangGraph loop: the planner is asked again until it says "done", within a recursion
    limit of 4 steps; a planner that never says it is LangGraph's `GraphRecursionError`, the
    policy's failure."""
    from typing import TypedDict

    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        notes: str

    llm = ChatOpenAI(model="planner", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)

    def think(s: State) -> State:
        return {"notes": s.get("notes", "") + str(llm.invoke(f"Q:{problem}\n{s.get('notes', '')}P:").content)}

    g = StateGraph(State)
    g.add_node("think", think)
    g.add_edge(START, "think")
    g.add_conditional_edges("think", lambda s: END if "done" in s["notes"] else "think")
    return g.compile().invoke({}, {"recursion_limit": 4})["notes"]


def langgraph_forced_tool(problem: str, client: OpenAI) -> str:
    """LangGraph's prebuilt agent made to call its calculator (`tool_choice="required"`): after the
    forced `<tool_call>` start an untrained model never writes a call that parses, and the agent
    ends on that answer (langchain-openai reads it as text): flexmarl's `MalformedToolCall`."""
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    from examples.programs.react_calculator import calculator

    llm = ChatOpenAI(model="solver", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    agent = create_react_agent(llm.bind_tools([calculator], tool_choice="required"), [calculator])
    out = agent.invoke({"messages": [("user", f"Compute {problem}")]}, {"recursion_limit": 6})
    return str(out["messages"][-1].content)


def tiny_turns(problem: str, client: OpenAI) -> str:
    """configs/tiny.yaml's YAML team as a program, its solver in turns (its system message and
    its template as the user's; tests/unit/test_export.py `TURNS`): the same prompts."""
    plan = _ask(client, "planner", f"Q:{problem}\nP:")
    r = client.chat.completions.create(model="solver", messages=[
        {"role": "system", "content": "Solve it."}, {"role": "user", "content": f"Q:{problem}\nP:{plan}\nA:"}])
    return _ask(client, "verifier", f"Q:{problem}\nA:{r.choices[0].message.content or ''}\nV:")
