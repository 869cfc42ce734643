"""What reporting an op as a Prefect task run costs the API server, per op and per event.

    python bench/task_run_events.py --json runs/bench/task_run_events.json [--ops 600] [--repeats 2]

Reports `n` ops of one flow run through `tasks/task_runs.py` `TaskRunReporter` the way the training
flow does, in three ways, alternating: `one_event` (each op ends before `pending_after_s`: its
final state only, the default), `two_events` (`pending_after_s=0`: Pending at submit, then
Completed), and `post_batches` (the same final-state events sent 50 per `POST /api/events`
instead of one websocket message each). Measures the local server's CPU (`bench/e2e.py`
`server_cpu_s`: a server flexmarl started, found through PREFECT_HOME) from the first event
until the server has recorded every task run, minus its idle rate over that time. CPU, not
wall time, so a loaded machine changes it less.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


async def _new_flow_run() -> str:
    from prefect import get_client

    async with get_client() as c:
        flow_id = await c.create_flow_from_name("flexmarl-bench-task-run-events")
        r = await c._client.post("/flow_runs/", json={"flow_id": str(flow_id), "name": "task-run-events"})
        r.raise_for_status()
        return r.json()["id"]


async def _count(flow_run_id: str) -> int:
    from prefect import get_client

    async with get_client() as c:
        r = await c._client.post("/task_runs/count", json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
        return int(r.json())


def _report(mode: str, n: int, flow_run_id: str, api: str) -> None:
    import httpx

    from flexmarl_core.ops import Op, StageResult
    from tasks.task_runs import TaskRunReporter

    r = TaskRunReporter(flow_run_id, 1, pending_after_s=0.0 if mode == "two_events" else 3600.0, flush_s=0.0)
    sent: list = []
    if mode == "post_batches":  # capture the events instead of handing them to the events worker
        r._worker = type("Capture", (), {"send": staticmethod(sent.append)})()
        r._ctx = contextvars.Context()
    prev = None
    for i in range(n):
        op = Op(i, "reward", mb=0)
        t = time.time()
        r.submitted(op, [prev] if prev else [], t)
        r.finished(op, StageResult(op, worker="w0", t_start=t, t_end=time.time()))
        prev = op
    for k in range(0, len(sent), 50):
        body = "[" + ",".join(e.model_dump_json() for e in sent[k:k + 50]) + "]"
        httpx.post(f"{api}/events", content=body, headers={"content-type": "application/json"}).raise_for_status()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--ops", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bench.e2e import server_cpu_s
    from flexmarl.prefect_api import ensure_api

    api, _ = ensure_api()
    if server_cpu_s() is None:
        print("the Prefect API is not a server flexmarl started here (PREFECT_HOME): its CPU cannot be read",
              file=sys.stderr)
        return 1
    res: dict[str, list[float]] = {"one_event": [], "two_events": [], "post_batches": []}
    with temporary_settings(updates={PREFECT_API_URL: api}):
        c0, t0 = server_cpu_s(), time.time()
        time.sleep(10)
        idle = (server_cpu_s() - c0) / (time.time() - t0)  # type: ignore[operator]
        for rep in range(args.repeats):
            for mode in (list(res) if rep % 2 == 0 else list(reversed(res))):
                fr = asyncio.run(_new_flow_run())
                c0, t0 = server_cpu_s(), time.time()
                _report(mode, args.ops, fr, api)
                deadline = time.time() + 120
                while asyncio.run(_count(fr)) < args.ops and time.time() < deadline:
                    time.sleep(0.25)
                time.sleep(2.0)  # the last batch's states, and whatever else it triggers
                used = server_cpu_s() - c0 - idle * (time.time() - t0)  # type: ignore[operator]
                res[mode].append(1000 * used / args.ops)
                print(f"repeat {rep} {mode}: {res[mode][-1]:.2f} ms server CPU per op", file=sys.stderr)
    out = {"ops": args.ops, "repeats": args.repeats, "idle_cpu_s_per_s": idle,
           "server_cpu_ms_per_op": {k: statistics.median(v) for k, v in res.items()}, "runs": res}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["server_cpu_ms_per_op"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
