"""The ReAct calculator agent of `react_calculator.py` written against the stock `openai` client
alone: one call with the calculator tool, the tool run on each call the model makes, its result
sent back, and the model's answer. It sends the messages LangGraph's prebuilt agent sends, so it
trains from the same SFT start (`configs/program_react.yaml` with
`team.program=examples/programs/calculator_openai.py:team`); `bench/program.py --tools-from`
times its calls with flexmarl's client, which a LangChain client does not pass through.
"""

import json
import re

from openai import OpenAI

_OP = re.compile(r"\s*(\d{1,6})\s*([+*-])\s*(\d{1,6})\s*")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Compute one operation of two integers: `a+b`, `a-b` or `a*b`.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    m = _OP.fullmatch(expression)
    if not m:
        return "error: give one operation of two integers, like 47*23"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def team(problem: str, client: OpenAI) -> str:
    messages: list = [{"role": "user", "content": f"Compute {problem}"}]
    for _ in range(6):
        reply = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS).choices[0].message
        if not reply.tool_calls:
            return (reply.content or "").strip()
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(str(args.get("expression", "")))})
    return ""
