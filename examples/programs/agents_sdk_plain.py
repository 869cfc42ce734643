"""Two OpenAI Agents SDK agents in sequence on the SDK's default model class,
`OpenAIResponsesModel` (the Responses API), plain text output: what a new user writes first. From
untrained weights every answer runs to the agent's token limit; the endpoint then answers
`incomplete`, as the Responses API does, and the SDK raises `ModelBehaviorError`. That is the
policy's failure (`team.policy_errors`): the trajectory's calls are trained with
`team.failure_reward` (`configs/program_sdk_plain.yaml`).

Each agent's model is given the trajectory's client, not `set_default_openai_client`: that sets
one client for the whole process, and two program ops running at once in one process would
send their calls through each other's clients.
"""

from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # no trace export: the run has no OpenAI account to send it to


async def team(problem: str, client: AsyncOpenAI) -> str:
    planner = Agent(name="planner", instructions="Say how to compute it, briefly.",
                    model=OpenAIResponsesModel(model="planner", openai_client=client))
    solver = Agent(name="solver", instructions="Answer with the number only.",
                   model=OpenAIResponsesModel(model="solver", openai_client=client))
    plan = await Runner.run(planner, f"Q:{problem}")
    answer = await Runner.run(solver, f"Q:{problem}\nPlan: {plan.final_output}")
    return str(answer.final_output).strip()
