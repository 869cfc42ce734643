"""A planner -> solver team in LangGraph that streams and asks for structured output, as such
programs are written: the planner's tokens are streamed (`stream_mode="messages"`, a live
view of its plan) and the solver answers through `with_structured_output`, so its answer is
JSON of the `Answer` schema (`configs/program_structured.yaml`). flexmarl's endpoint serves the
stream and decodes the solver's answer constrained to the schema.
"""

from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from openai import OpenAI
from pydantic import BaseModel


class Answer(BaseModel):
    value: int


class State(TypedDict, total=False):
    problem: str
    plan: str
    answer: int


def team(problem: str, client: OpenAI) -> str:
    def llm(agent: str, **kw) -> ChatOpenAI:
        return ChatOpenAI(model=agent, base_url=str(client.base_url), api_key=client.api_key, max_retries=0, **kw)

    planner = llm("planner", streaming=True)
    solver = llm("solver").with_structured_output(Answer, method="json_schema")

    def plan(s: State) -> State:
        return {"plan": planner.invoke(f"Q:{s['problem']}\nP:").content}

    def solve(s: State) -> State:
        return {"answer": solver.invoke(f"Q:{s['problem']}\nP:{s['plan']}\nA:").value}

    g = StateGraph(State)
    g.add_node("plan", plan)
    g.add_node("solve", solve)
    g.add_edge(START, "plan")
    g.add_edge("plan", "solve")
    g.add_edge("solve", END)
    graph = g.compile()
    final: State = {}
    for mode, data in graph.stream({"problem": problem}, stream_mode=["messages", "values"]):
        if mode == "values":
            final = data  # the state after each step; the planner's tokens arrive as "messages"
    return str(final["answer"])
