"""Team programs for tests (imported by name, also inside Dask workers): plain functions of
(problem, client), as users write them."""

from __future__ import annotations

from openai import OpenAI


def _ask(client: OpenAI, agent: str, prompt: str) -> str:
    r = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": prompt}])
    return r.choices[0].message.content or ""


def half_fail(problem: str, client: OpenAI) -> str:
    """The default team, except that a problem whose first digit is odd makes it raise after
    its planner call (a bug of the program's own, not of flexmarl)."""
    plan = _ask(client, "planner", f"Q:{problem}\nP:")
    if int(next(c for c in problem if c.isdigit())) % 2:
        raise ValueError(f"cannot handle {problem!r}")
    answer = _ask(client, "solver", f"Q:{problem}\nP:{plan}\nA:")
    return _ask(client, "verifier", f"Q:{problem}\nA:{answer}\nV:")


def always_fail(problem: str, client: OpenAI) -> str:
    _ask(client, "planner", f"Q:{problem}\nP:")
    raise RuntimeError("this program is broken")
