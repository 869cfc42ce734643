"""The default arithmetic team (planner -> solver -> verifier) as a plain program.

It talks to its agents through a stock OpenAI client and imports nothing from flexmarl: point
`client` at any OpenAI-compatible server that serves models named planner, solver and verifier
and it runs unchanged. flexmarl trains it with `configs/program_team.yaml`.
"""

from openai import OpenAI


def ask(client: OpenAI, agent: str, prompt: str) -> str:
    reply = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": prompt}])
    return reply.choices[0].message.content or ""


def team(problem: str, client: OpenAI) -> str:
    plan = ask(client, "planner", f"Q:{problem}\nP:")
    answer = ask(client, "solver", f"Q:{problem}\nP:{plan}\nA:")
    return ask(client, "verifier", f"Q:{problem}\nA:{answer}\nV:")
