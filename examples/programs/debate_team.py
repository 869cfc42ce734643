"""Two agents debate until they agree: each answers, then, while their answers differ, each
reads the other's and answers again (at most three rounds). The team's answer is the first
agent's last one. Plain OpenAI client, nothing from flexmarl: `configs/program_debate.yaml`
trains it.
"""

from openai import OpenAI

ROUNDS = 3


def ask(client: OpenAI, agent: str, prompt: str) -> str:
    reply = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": prompt}])
    return (reply.choices[0].message.content or "").strip()


def team(problem: str, client: OpenAI) -> str:
    a = ask(client, "alice", f"Q:{problem}\nA:")
    b = ask(client, "bob", f"Q:{problem}\nA:")
    for _ in range(ROUNDS - 1):
        if a == b:
            break
        a, b = (ask(client, "alice", f"Q:{problem}\nA:{a}\nB:{b}\nA:"),
                ask(client, "bob", f"Q:{problem}\nB:{b}\nA:{a}\nB:"))
    return a
