"""An OpenAI Agents SDK agent on the SDK's default model, which speaks the Responses API, run
streamed, with a typed output (`configs/program_responses.yaml`). The program installs the
client it is given as the SDK's default, as the SDK's docs say to for another provider; flexmarl
records each call under the trajectory that makes it.
"""

from agents import Agent, Runner, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI
from pydantic import BaseModel

set_tracing_disabled(True)  # no trace export: the run has no OpenAI account to send it to


class Answer(BaseModel):
    value: int


async def team(problem: str, client: AsyncOpenAI) -> str:
    set_default_openai_client(client, use_for_tracing=False)
    solver = Agent(name="solver", instructions="Compute the expression.", model="solver", output_type=Answer)
    run = Runner.run_streamed(solver, f"Q:{problem}")
    async for _ in run.stream_events():  # a live view of the answer, as a UI would take it
        pass
    return str(run.final_output.value)
