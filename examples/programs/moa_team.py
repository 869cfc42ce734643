"""A mixture of agents: three proposers answer the problem on their own, then an aggregator
reads their answers and gives the team's. Plain OpenAI client, nothing from flexmarl:
`configs/program_moa.yaml` trains it (the YAML version is `configs/moa.yaml`).
"""

from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

PROPOSERS = ("p1", "p2", "p3")


def ask(client: OpenAI, agent: str, prompt: str) -> str:
    reply = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": prompt}])
    return (reply.choices[0].message.content or "").strip()


def team(problem: str, client: OpenAI) -> str:
    with ThreadPoolExecutor(len(PROPOSERS)) as pool:  # the proposers answer at once
        answers = list(pool.map(lambda p: ask(client, p, f"Q:{problem}\nA:"), PROPOSERS))
    listed = "".join(f"{i}:{a}\n" for i, a in enumerate(answers, 1))
    return ask(client, "aggregator", f"Q:{problem}\n{listed}A:")
