"""What a run's program ops measured of the endpoint, from its op log (`metrics/ops.jsonl`), and
what one call costs the machine beyond its decode (`call_cpu_ms`)."""

from __future__ import annotations

import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from flexmarl_core.inference.api import Generation
from flexmarl_core.programs.api import DecodeGroup, DecodeStats
from flexmarl_core.programs.gateway import Gateway, Session
from flexmarl_core.programs.team import ProgramTeam


def program_figures(ops: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """Over a run's program ops: `call_overhead_ms_p50` / `_p99` (the median over ops of each
    op's p50 and p99 of a call's client-side time beyond waiting for and running its decode:
    HTTP, JSON, templating, tokenising; `server_overhead_ms_p50`: the endpoint's own share of
    it), `requests_per_decode` (requests per decode batch,
    over all decodes), `decodes`, `failed_trajectories` and `calls_per_trajectory` per agent."""
    prog = [o for o in ops if o.get("kind") == "program" and not o.get("skipped")]
    p50 = [o["team/program/call_overhead_ms_p50"] for o in prog if "team/program/call_overhead_ms_p50" in o]
    p99 = [o["team/program/call_overhead_ms_p99"] for o in prog if "team/program/call_overhead_ms_p99" in o]
    server = [o["team/program/server_overhead_ms_p50"] for o in prog if "team/program/server_overhead_ms_p50" in o]
    decodes = sum(o.get("team/program/decodes", 0.0) for o in prog)
    requests = sum(o.get("team/program/requests_per_decode", 0.0) * o.get("team/program/decodes", 0.0) for o in prog)
    calls: dict[str, list[float]] = {}
    for o in prog:
        for k, v in o.items():
            if k.startswith("agent/") and k.endswith("/calls"):
                calls.setdefault(k.split("/")[1], []).append(v)
    return {
        "program_ops": float(len(prog)),
        "call_overhead_ms_p50": statistics.median(p50) if p50 else None,
        "call_overhead_ms_p99": statistics.median(p99) if p99 else None,
        "server_overhead_ms_p50": statistics.median(server) if server else None,
        "requests_per_decode": requests / decodes if decodes else None,
        "decodes": decodes,
        "failed_trajectories": sum(o.get("team/program/failed", 0.0) for o in prog),
        "calls_per_trajectory": {a: statistics.fmean(v) for a, v in sorted(calls.items())},
    }


class _Answers:
    """A dispatcher that answers every call at once with one fixed token: the endpoint's own
    cost with no decode behind it (a measuring device, not an engine)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def capacity(self, agent: str) -> int:
        return 1

    def decode(self, agent: str, version: int, groups: Sequence[DecodeGroup], stats: DecodeStats) -> list[list[Generation]]:
        return [[Generation(list(g.prompt_ids), [self.token], "", [0.0], "length", version)] * g.n for g in groups]


_CLIENT = """
import sys, time, httpx, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], http_client=httpx.Client(), max_retries=0)
def call():
    c.chat.completions.create(model=sys.argv[3], messages=[{"role": "user", "content": sys.argv[4]}])
for _ in range(20):
    call()
t0 = time.process_time()
for _ in range(int(sys.argv[5])):
    call()
print(time.process_time() - t0)
"""


def call_cpu_ms(team: ProgramTeam, prompt: str, calls: int = 300) -> dict[str, float]:
    """CPU milliseconds one chat call costs beyond its decode, measured one call at a time on
    this machine: `client` (a stock `openai.OpenAI` in a process of its own: building the
    request, HTTP, parsing the response) and `endpoint` (this process: HTTP, JSON, templating,
    tokenising, recording). What a program pays per call on top of a YAML team's work."""
    agent = next(iter(team.agents))
    gw = Gateway.shared()
    session = Session(secrets.token_urlsafe(16), team.agents, dict.fromkeys(team.agents, 0),
                      _Answers(0), lambda *_: 0, window_s=0.0)
    t = gw.open(session, "cost", 0, 0)
    try:
        before = time.process_time()
        out = subprocess.run([sys.executable, "-c", _CLIENT, gw.base_url, t.key, agent, prompt,
                              str(calls)], capture_output=True, text=True, timeout=600)
        endpoint = time.process_time() - before
    finally:
        gw.finish(t)
        gw.close(session)
    if out.returncode != 0:
        raise RuntimeError(f"the client process failed: {out.stderr[-2000:]}")
    return {"client": 1e3 * float(out.stdout.split()[-1]) / calls, "endpoint": 1e3 * endpoint / (calls + 20)}
