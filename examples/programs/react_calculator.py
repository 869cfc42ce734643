"""A ReAct agent with a calculator tool, written with LangGraph's prebuilt agent over
langchain-openai's ChatOpenAI: an existing framework's program, trained unchanged
(`configs/program_react.yaml`). The agent calls `calculator` on one operation at a time
(`47*23`), reads the result back, and answers the number.

It needs only an OpenAI-compatible base URL and key, which it takes from the client flexmarl
passes; against any server that serves a model named `solver` with tool calls it runs as is.
"""

import re

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from openai import OpenAI

_OP = re.compile(r"\s*(\d{1,6})\s*([+*-])\s*(\d{1,6})\s*")


@tool
def calculator(expression: str) -> str:
    """Compute one operation of two integers: `a+b`, `a-b` or `a*b`."""
    m = _OP.fullmatch(expression)
    if not m:
        return "error: give one operation of two integers, like 47*23"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def team(problem: str, client: OpenAI) -> str:
    llm = ChatOpenAI(model="solver", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    agent = create_react_agent(llm, [calculator])
    out = agent.invoke({"messages": [("user", f"Compute {problem}")]}, {"recursion_limit": 12})
    return str(out["messages"][-1].content).strip()
