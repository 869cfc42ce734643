"""Chaos: the default team on the real stack (a Prefect API server of its own, flexmarl's local
Dask cluster, the run folder and MEG Store on S3 behind `tests._fault_proxy`) with faults of
the machinery injected at seeded points, against the same run undisturbed.

    .venv/bin/python bench/chaos.py --json runs/bench/chaos.json [--quick] [--seed 0]

Faults: 4 worker kills (`kill@` on seeded rollout and train ops), a Prefect API outage
(`--outage-s`, from a seeded iteration on), a burst of S3 errors (the next `BURST` requests
answered 503, from another seeded iteration), one hung op (`hang@`, caught by
`cluster.deadlines`). Checks: the audit finds no duplicate and no missing sample; the final
weights equal the undisturbed run's (rtol 1e-4, atol 1e-6, as the resume tests); every kill shows as a
`resubmit` of its op in the decision log, the hang as `hung_op`, the S3 burst as all its 503s
sent and retried (`store_retries` of a stage, or the flow's own uploads retried,
`flow_store_retries`); the API outage, which the run never sees, as every op's task run completed in
the API afterwards. JSON keys: `faults_injected`, `faults_survived`, `audit_errors`,
`weights_tolerance_ratio` (at most 1: equal within rtol 1e-4, atol 1e-6), `wall_s_undisturbed`, `wall_s_chaos`, `wall_cost_ratio`, `decisions`.

Then the operator's mistakes (`bench/chaos_operator.py`, `--no-operator` skips them): a double
launch, a hanging reward, a full disk and a damaged store, each through the CLI on the tiny
team, and a Prefect API killed for good. JSON keys: `operator_mistakes` (each one's result),
`operator_injected`, `operator_survived`, `dead_api_exit_s` (seconds from the killed API to the
process's exit; promised under 90).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from flexmarl_core.driver.metrics import log_lines

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench-chaos"
os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "7")  # as `flexmarl train` sets it
#: The API outage may overlap the run's end, and the server's restart stretches it past the
#: outage: the bench's own runs wait for the API longer than a run's default budget
#: (`tasks/api_watch.py`); the operator phase's dead API keeps the default.
os.environ.setdefault("FLEXMARL_API_GIVE_UP_S", "300")
#: consecutive S3 requests answered 503: past the SDK's own 3 tries (so flexmarl's retries act),
#: short of the 18 requests one call may make under the default store.retries (6 x 3)
BURST = 15


def ops_of(loc) -> list[dict]:  # noqa: ANN001 - a RunLocation
    return [json.loads(x) for x in log_lines(loc, "ops.jsonl") if x.strip()]


def run(config: str, overrides: list[str]) -> float:
    from flows.train import train

    t0 = time.time()
    state = train(config, overrides, progress=False, return_state=True)
    if not state.is_completed():
        raise SystemExit(f"run failed: {state.message}")
    return time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="6 iterations of a smaller batch, a 20 s outage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--outage-s", type=float, default=None)
    ap.add_argument("--config", default=str(REPO / "configs" / "default.yaml"))
    ap.add_argument("--no-operator", action="store_true", help="skip the operator's mistakes")
    ap.add_argument("--deadline-floor-s", type=float, default=45.0,
                    help="cluster.deadlines.floor_s: past the S3 burst's backoff, so only the hang trips it")
    args = ap.parse_args()
    iterations = args.iterations or (6 if args.quick else 30)
    outage = args.outage_s if args.outage_s is not None else (20.0 if args.quick else 60.0)
    rng = random.Random(args.seed)

    from flexmarl.prefect_api import start_server, stop_server
    from flexmarl_core.driver.audit import audit_run
    from flexmarl_core.runfiles.location import RunLocation
    from storage import retry
    from tests._fault_proxy import FaultProxy
    from tests._s3 import start_s3

    moto = start_s3(BUCKET)  # sets AWS_ENDPOINT_URL to moto; the runs go through the proxy
    direct = os.environ["AWS_ENDPOINT_URL"]
    proxy = FaultProxy(direct, seed=args.seed).start()
    os.environ["AWS_ENDPOINT_URL"] = proxy.url  # before any cluster starts: its workers inherit it
    home = Path(tempfile.mkdtemp(prefix="flexmarl-chaos-prefect-"))
    api = start_server(home, 4300 + rng.randrange(500))
    port = urlsplit(api).port
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tag = uuid.uuid4().hex[:6]
    base = [f"train.iterations={iterations}", "train.warm_start=none", "train.evaluate=false",
            f"cluster.deadlines.floor_s={args.deadline_floor_s}", "train.checkpoint_every=1"]
    if args.quick:
        base += ["batch.inputs_per_iteration=32", "batch.micro_batch_inputs=8"]
    calm_uri, chaos_uri = (f"s3://{BUCKET}/{tag}/{k}" for k in ("calm", "chaos"))

    def peek(uri: str) -> RunLocation:  # the bench's own reads go to moto directly
        host = direct.removeprefix("http://")
        return RunLocation(f"{uri}?endpoint_override={host}&scheme=http&region=us-east-1")

    try:
        with temporary_settings(updates={PREFECT_API_URL: api}):
            wall_calm = run(args.config, [f"run_dir={calm_uri}", *base])
            calm_ops = ops_of(peek(calm_uri))
            pool = sorted({o["op"] for o in calm_ops if o["kind"] in ("rollout", "train") and o["iteration"] >= 1})
            by_it: dict[int, list[str]] = {}
            for name in pool:
                by_it.setdefault(int(name.split(" it=")[1].split()[0]), []).append(name)
            its = rng.sample(sorted(by_it), k=min(5, len(by_it)))
            kills = [rng.choice(by_it[i]) for i in its[:4]]
            hang = rng.choice([n for n in by_it[its[4 % len(its)]] if n not in kills and n.startswith("rollout")]
                              or [n for n in pool if n not in kills])
            it_api, it_s3 = rng.sample(range(1, iterations), k=2)
            faults = RunLocation(chaos_uri).sibling(".faults")
            for name in kills:
                faults.write_text(f"kill@{name}", "")
            faults.write_text(f"hang@{hang}", "")
            seen = {"api": None, "s3": None}

            def watch() -> None:
                loc = peek(chaos_uri)
                while seen["api"] is None or seen["s3"] is None:
                    top = max((o["iteration"] for o in ops_of(loc)), default=-1)
                    if seen["s3"] is None and top >= it_s3:
                        proxy.burst(BURST, "503")
                        seen["s3"] = time.time()
                    if seen["api"] is None and top >= it_api:
                        seen["api"] = time.time()
                        stop_server(home, signal.SIGKILL)
                        time.sleep(outage)
                        if start_server(home, port) != api:
                            raise RuntimeError(f"the Prefect server came back elsewhere than {api}")
                    if done.is_set():
                        return
                    time.sleep(0.5)

            done = threading.Event()
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            t_chaos = time.time()
            flow_r0 = retry.retried()  # the flow runs here: its own uploads ride out 503s too
            try:
                wall_chaos = run(args.config, [f"run_dir={chaos_uri}", *base])
            finally:
                done.set()
                watcher.join(timeout=outage + 240)
            chaos_loc = peek(chaos_uri)
            decisions = [json.loads(x) for x in log_lines(chaos_loc, "decisions.jsonl") if x.strip()]
            chaos_ops = {o["op"] for o in ops_of(chaos_loc)}
            task_runs = asyncio.run(_completed_task_runs(chaos_ops))
        if not args.no_operator:
            sys.path.insert(0, str(REPO))
            from chaos_operator import operator_phase

            operator = operator_phase(api)
        else:
            operator = {}
        problems = audit_run(chaos_uri).problems
        audit_errors = sum(p.severity == "error" for p in problems)
        diff = _weights_diff(peek(calm_uri), chaos_loc, iterations)
    finally:
        stop_server(home, signal.SIGKILL)
        proxy.stop()
        moto.stop()

    resubmitted = {d["op"] for d in decisions if d["decision"] == "resubmit"}
    fired = {f"kill@{k}": k in resubmitted for k in kills}
    # Cancelled past its deadline, or lost with a worker killed meanwhile: either way rerun.
    fired[f"hang@{hang}"] = any(d["decision"] in ("hung_op", "resubmit") and hang in d["op"].split(" + ")
                                for d in decisions)  # a fused run's hung_op names all its ops
    # The burst's 503s land on whichever requests come next: a stage's (a `store_retries`
    # decision) or the flow's own (its op-log uploads, retried in this process).
    flow_retries = retry.retried() - flow_r0
    fired["s3 burst"] = seen["s3"] is not None and proxy.injected["503"] >= BURST and (
        flow_retries > 0 or any(d["decision"] == "store_retries" for d in decisions))
    fired["api outage"] = seen["api"] is not None and chaos_ops <= task_runs
    out = {
        "seed": args.seed, "iterations": iterations, "quick": args.quick, "outage_s": outage,
        "faults_injected": len(fired), "faults_survived": sum(fired.values()), "faults": fired,
        "audit_errors": audit_errors, "weights_tolerance_ratio": round(diff, 4),
        "wall_s_undisturbed": round(wall_calm, 1), "wall_s_chaos": round(wall_chaos, 1),
        "wall_cost_ratio": round(wall_chaos / wall_calm, 3),
        "hung_ops": [d["op"] for d in decisions if d["decision"] == "hung_op"],
        "api_outage_at_s": None if seen["api"] is None else round(seen["api"] - t_chaos, 1),
        "task_runs_missing": sorted(chaos_ops - task_runs)[:10],
        "decisions": {k: sum(d["decision"] == k for d in decisions) for k in
                      ("resubmit", "hung_op", "store_retries", "move_instance", "train_slot")},
        "proxy_injected": dict(proxy.injected), "flow_store_retries": flow_retries,
        "operator_mistakes": operator,
        "operator_injected": sum(1 for r in operator.values() if r["survived"] is not None),
        "operator_survived": sum(1 for r in operator.values() if r["survived"]),
        "dead_api_exit_s": operator.get("dead api", {}).get("dead_api_exit_s"),
    }
    print(f"{'fault':<44} survived")
    for k, v in fired.items():
        print(f"{k:<44} {v}")
    for k, r in operator.items():
        print(f"{k:<44} {r['survived'] if r['survived'] is not None else 'not run: ' + r.get('not_run', '')}")
    print(f"audit errors {audit_errors}; weights {diff:.3f} of the tolerance; wall {wall_calm:.0f} s undisturbed, "
          f"{wall_chaos:.0f} s with faults ({out['wall_cost_ratio']:.2f}x)")
    if out["dead_api_exit_s"] is not None:
        print(f"dead API: the run's process exited {out['dead_api_exit_s']:.0f} s after its Prefect API was killed")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    ok = audit_errors == 0 and diff <= 1.0 and all(fired.values()) and out["operator_survived"] == out["operator_injected"]
    return 0 if ok else 1


async def _completed_task_runs(want: set[str], patience_s: float = 120.0) -> set[str]:
    """The names of the last flow run's completed task runs, polled until they cover `want`
    (events buffered during an outage reach the server some seconds after it is back)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
    )

    deadline = time.monotonic() + patience_s
    async with get_client() as c:
        # the training run's: the newest without a parent (its iterations' flow runs are nested)
        runs = sorted((r for r in await c.read_flow_runs() if r.parent_task_run_id is None),
                      key=lambda r: r.start_time or r.created)
        while True:
            kids = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[runs[-1].id])))
            flt = FlowRunFilter(id=FlowRunFilterId(any_=[runs[-1].id, *(k.id for k in kids)]))
            got: set[str] = set()
            offset = 0
            while True:
                page = await c.read_task_runs(flow_run_filter=flt, limit=200, offset=offset)
                got |= {r.name for r in page if r.state and r.state.is_completed()}
                if len(page) < 200:
                    break
                offset += 200
            if want <= got or time.monotonic() > deadline:
                return got
            await asyncio.sleep(2)


def _weights_diff(a, b, version: int) -> float:  # noqa: ANN001 - RunLocations
    """The largest |b - a| / (atol + rtol |a|) over every agent's final weights: at most 1 means
    equal within the resume tests' tolerance (rtol 1e-4, atol 1e-6)."""
    from safetensors.torch import load

    worst = 0.0
    for agent in a.list("weights", dirs=True):
        wa, wb = (load(loc.read_bytes(f"weights/{agent}/v{version}.safetensors")) for loc in (a, b))
        for k, t in wa.items():
            if t.numel():
                worst = max(worst, float(((wb[k] - t).abs() / (1e-6 + 1e-4 * t.abs())).max()))
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
