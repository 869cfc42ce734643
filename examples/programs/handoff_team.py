"""A triage agent that hands arithmetic to a solver, written with the OpenAI Agents SDK on
`OpenAIChatCompletionsModel` (`configs/program_handoff.yaml`). A handoff is a tool call
(`transfer_to_solver`): the SDK then sends the conversation to the solver's model, which
answers. It takes the client flexmarl passes and imports nothing from flexmarl.
"""

from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # no trace export: the run has no OpenAI account to send it to


async def team(problem: str, client: AsyncOpenAI) -> str:
    solver = Agent(name="solver", instructions="Answer with the number only.",
                   model=OpenAIChatCompletionsModel(model="solver", openai_client=client))
    triage = Agent(name="triage", instructions="Hand arithmetic to the solver.", handoffs=[solver],
                   model=OpenAIChatCompletionsModel(model="planner", openai_client=client))
    result = await Runner.run(triage, f"Compute {problem}", max_turns=6)
    return str(result.final_output).strip()
