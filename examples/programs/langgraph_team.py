"""The default arithmetic team (planner -> solver -> verifier) as a LangGraph graph over
langchain-openai's ChatOpenAI: an existing framework's program, trained unchanged. It only
needs an OpenAI-compatible base URL and key, which it takes from the client flexmarl passes
(`configs/program_langgraph.yaml`).
"""

from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from openai import OpenAI


class State(TypedDict, total=False):
    problem: str
    plan: str
    answer: str
    verdict: str


def build(base_url: str, api_key: str):
    def llm(agent: str) -> ChatOpenAI:
        return ChatOpenAI(model=agent, base_url=base_url, api_key=api_key, max_retries=0)

    planner, solver, verifier = llm("planner"), llm("solver"), llm("verifier")

    def plan(s: State) -> State:
        return {"plan": planner.invoke(f"Q:{s['problem']}\nP:").content}

    def solve(s: State) -> State:
        return {"answer": solver.invoke(f"Q:{s['problem']}\nP:{s['plan']}\nA:").content}

    def verify(s: State) -> State:
        return {"verdict": verifier.invoke(f"Q:{s['problem']}\nA:{s['answer']}\nV:").content}

    g = StateGraph(State)
    g.add_node("plan", plan)
    g.add_node("solve", solve)
    g.add_node("verify", verify)
    g.add_edge(START, "plan")
    g.add_edge("plan", "solve")
    g.add_edge("solve", "verify")
    g.add_edge("verify", END)
    return g.compile()


def team(problem: str, client: OpenAI) -> str:
    graph = build(str(client.base_url), client.api_key)
    return graph.invoke({"problem": problem})["verdict"]
