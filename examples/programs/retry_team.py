"""A solver that tries again until a verifier accepts its answer, at most three tries.

The verifier reads the problem and the solver's answer and writes the value it finds; the
program accepts when the two agree, else it shows the solver its rejected tries and asks
again. So a trajectory calls each agent one to three times. Plain OpenAI client, nothing
from flexmarl: `configs/program_retry.yaml` trains it.
"""

from openai import OpenAI

TRIES = 3


def ask(client: OpenAI, agent: str, prompt: str) -> str:
    reply = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": prompt}])
    return (reply.choices[0].message.content or "").strip()


def team(problem: str, client: OpenAI) -> str:
    rejected = ""
    for _ in range(TRIES):
        answer = ask(client, "solver", f"Q:{problem}\n{rejected}A:")
        verdict = ask(client, "verifier", f"Q:{problem}\nA:{answer}\nV:")
        if verdict == answer:
            break
        rejected += f"A:{answer}\nV:{verdict}\n"  # what the solver sees on its next try
    return verdict
