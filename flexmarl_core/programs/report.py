"""What a run's program ops measured of the endpoint, from its op log (`metrics/ops.jsonl`)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


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
