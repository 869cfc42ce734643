"""The calculator agent of `react_calculator.py` written in AutoGen AgentChat: an
`AssistantAgent` with a calculator tool that reflects on the tool's result, streamed, over
autogen-ext's `OpenAIChatCompletionClient` pointed at the endpoint flexmarl gives.

AutoGen is not a flexmarl dependency: install it in the same `pip install` as flexmarl
(`pip install -e '.[dev]' autogen-agentchat 'autogen-ext[openai]'`), then
`flexmarl train configs/program_react.yaml --set team.program=examples/programs/autogen_calculator.py:team`.
Its tool call and its reflection (a call that sends no tools) are two samples of `solver`
(docs/programs.md, "Frameworks tried").
"""

import re

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient
from openai import AsyncOpenAI

_OP = re.compile(r"\s*(\d{1,6})\s*([+*-])\s*(\d{1,6})\s*")
#: the model is not an OpenAI one, so AutoGen must be told what it can do
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False,
              "family": "unknown", "structured_output": False}


def calculator(expression: str) -> str:
    """Compute one operation of two integers: `a+b`, `a-b` or `a*b`."""
    m = _OP.fullmatch(expression)
    if not m:
        return "error: give one operation of two integers, like 47*23"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


async def team(problem: str, client: AsyncOpenAI) -> str:
    model_client = OpenAIChatCompletionClient(model="solver", base_url=str(client.base_url),
                                              api_key=client.api_key, model_info=MODEL_INFO)
    agent = AssistantAgent("solver", model_client=model_client, tools=[calculator],
                           reflect_on_tool_use=True, model_client_stream=True)
    try:
        result = await agent.run(task=f"Compute {problem}")
    finally:
        await model_client.close()
    return str(result.messages[-1].content).strip()
