"""The orchestration floor: what flexmarl costs per op on fine-grained work.

    python bench/overhead.py --json runs/bench/overhead.json [--quick] [--repeats 3]
        [--baseline cluster.look_ahead=false --baseline cluster.pending_after_s=0] [--api ambient]

Runs `configs/overhead.yaml` (one agent, a 1.1M-parameter model, 8 prompts x G 8 completions
of at most 8 tokens per step, one worker with 2 torch threads; 5 ops per step) through the
training flow `flexmarl train` runs (Prefect flow, Dask worker, MEG Store), and, as the
reference, the same stage functions called in this process in a plain loop, same seed; both
must reach the same final weights. Keys: `flexmarl_s` and `reference_s` (the ops' wall time:
first op submitted to last op done; setup excluded in both), `ratio` (reference / flexmarl),
`ops`, `bookkeeping_cpu_ms_per_op` (flow process incl. the in-process Dask scheduler, and
worker, outside the stages), `dispatch_ms_p50` / `dispatch_ms_p99` (an op's last dependency's
end to its start, in the worker's clock), `prefect_overhead_frac` (bookkeeping share of CPU).
`--quick`: 60 steps instead of 500. `--repeats N` runs the reference and flexmarl alternately
N times (order reversed every other repeat) and reports medians, with the load average around
each run: on a shared machine wall times drift with the load, so compare runs of one
invocation. `--baseline KEY=VALUE` adds a flexmarl run with those overrides to every repeat
(under `baseline`), e.g. the orchestrator without look-ahead, for a side-by-side figure.

The Prefect API: by default a local server of the bench's own, with a new database (stopped at
the end), because the server's CPU per op grows with its database (about twice as much at
~40,000 task runs and ~65,000 events as fresh, `bench/task_run_events.py`), so a bench on
whatever server the machine has would measure the machine's history. `--api ambient`: the API
`flexmarl train` would use here (PREFECT_API_URL, or the local server in PREFECT_HOME).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _fresh import drain_prefect  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]

CONFIG = str(REPO / "configs" / "overhead.yaml")
#: steps of the unmeasured run that warms the API server up
WARMUP_STEPS = 10


def reference_run(overrides: list[str]) -> dict:
    """The reference in a fresh process with the worker's thread settings (a process that has
    imported Prefect and run a cluster is not a plain training loop): see `_reference`."""
    from flexmarl_core.config import load_config

    threads = str(load_config(CONFIG, overrides).cluster.torch_threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "FLEXMARL_TORCH_THREADS": threads}
    args = [sys.executable, __file__, "--reference-only", json.dumps(overrides), "--json", "-"]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _reference(overrides: list[str]) -> dict:
    """The plan's ops in dependency order, each `run_stage` called in this process: no
    orchestrator, no cluster, no store commit beyond what the stages do themselves."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver import run
    from flexmarl_core.orchestrator.plan import Plan
    from flexmarl_core.stages import run_stage

    cfg = load_config(CONFIG, overrides)
    run_dir = run.prepare_run(cfg, log=lambda _: None)
    plan = Plan.build(cfg)
    done: set = set()
    left = list(plan.deps)
    t0, c0 = time.time(), time.process_time()
    while left:
        ready = [op for op in left if all(d in done for d in plan.deps[op])]
        for op in ready:
            run_stage(str(run_dir), op)
            done.add(op)
        left = [op for op in left if op not in done]
    return {"run_dir": str(run_dir), "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0,
            "ops": len(done)}


def dispatch_ms(run_dir: Path, deps: dict) -> list[float]:
    """For every op with dependencies: its start minus its last dependency's end (ms)."""
    rows = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    by_name = {r["op"]: r for r in rows}
    out = []
    for op, ds in deps.items():
        if ds and op.name in by_name:
            out.append(1000 * (by_name[op.name]["t_start"] - max(by_name[d.name]["t_end"] for d in ds)))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def max_weight_diff(a: str, b: str, agents: list[str], version: int) -> float:
    from flexmarl_core.runtime.worker import load_weights

    worst = 0.0
    for agent in agents:
        wa, wb = load_weights(a, agent, version), load_weights(b, agent, version)
        worst = max(worst, *((wa[k] - wb[k]).abs().max().item() for k in wa))
    return worst


def flexmarl_run(train, api: str, overrides: list[str], steps: int, ref_dir: str | None,
                 home: Path | None = None) -> dict:
    """One run of `flexmarl train` (the Prefect flow on Dask) with `overrides`, measured;
    `home`: the PREFECT_HOME of the server to measure (default the environment's)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bench.e2e import server_cpu_s
    from flexmarl_core.config import load_config
    from flexmarl_core.meg import MEG
    from flexmarl_core.orchestrator.plan import Plan

    load0, srv0 = os.getloadavg()[0], server_cpu_s(home)
    with temporary_settings(updates={PREFECT_API_URL: api}):
        state = train(CONFIG, overrides, progress=False, overwrite=True, return_state=True)
    srv1, load1 = server_cpu_s(home), os.getloadavg()[0]
    if not state.is_completed():
        raise RuntimeError(f"flexmarl run failed: {state.message}")
    s = state.result()["summary"]
    cfg = load_config(CONFIG, overrides)
    meg = MEG.from_config(cfg.team)
    gaps = dispatch_ms(Path(s["run_dir"]), Plan.build(cfg).deps)
    ops = s["ops"]
    return {
        "wall_s": s["wall_s"], "ops": ops,
        "bookkeeping_cpu_ms_per_op": {
            "flow": 1000 * s["flow_cpu_s"] / ops, "worker": 1000 * s["worker_bookkeeping_cpu_s"] / ops,
            "total": 1000 * (s["flow_cpu_s"] + s["worker_bookkeeping_cpu_s"]) / ops},
        "dispatch_ms_p50": statistics.median(gaps), "dispatch_ms_p99": pct(gaps, 0.99),
        "prefect_overhead_frac": s["prefect_overhead_frac"], "stage_cpu_s": s["stage_cpu_s"],
        "server_cpu_ms_per_op": (1000 * (srv1 - srv0) / ops) if srv0 is not None and srv1 is not None else None,
        "final_weights_max_abs_diff": None if ref_dir is None else max_weight_diff(
            s["run_dir"], ref_dir, list(meg.trainable_agents), steps),
        "load": [round(load0, 2), round(load1, 2)],
    }


def _median(runs: list[dict], key: str, sub: str | None = None) -> float | None:
    xs = [r[key][sub] if sub else r[key] for r in runs]
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--quick", action="store_true", help="60 steps instead of 500")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run reference and flexmarl alternately this often; medians reported")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (both runs)")
    ap.add_argument("--baseline", action="append", default=[],
                    help="also run flexmarl with these overrides in each repeat (e.g. "
                    "cluster.look_ahead=false), reported under `baseline`")
    ap.add_argument("--api", default="fresh", choices=["fresh", "ambient"], help="fresh (default): a server of the bench's own "
                    "with a new database; ambient: the API `flexmarl train` would use here")
    ap.add_argument("--reference-only", default=None, help=argparse.SUPPRESS)  # JSON overrides
    args = ap.parse_args()
    if args.reference_only is not None:
        print(json.dumps(_reference(json.loads(args.reference_only))))
        return 0
    steps = args.steps or (60 if args.quick else 500)
    out_dir = REPO / "runs" / "bench-overhead"

    from flexmarl.prefect_api import ensure_api, start_server, stop_server

    with contextlib.ExitStack() as stack:
        home = None
        if args.api == "fresh":
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flexmarl-bench-prefect-")))
            stack.callback(stop_server, home)
            # Before the server stops: the flow runs' last logs and events still on their way.
            stack.callback(drain_prefect)
            api = start_server(home)
        else:
            api, _ = ensure_api()
        return _bench(args, steps, out_dir, api, home)


def _bench(args: argparse.Namespace, steps: int, out_dir: Path, api: str, home: Path | None) -> int:
    from flows.train import train

    common = [f"train.iterations={steps}", *args.set]
    variants = {"flexmarl": [f"run_dir={out_dir}/flexmarl", *common]}
    if args.baseline:
        variants["baseline"] = [f"run_dir={out_dir}/baseline", *common, *args.baseline]
    refs: list[dict] = []
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    # A new server's first flow run costs it about twice the CPU per op of later ones (its
    # caches fill): one short run first, not measured, so repeat 0 is like the others.
    flexmarl_run(train, api, [f"run_dir={out_dir}/warmup", f"train.iterations={WARMUP_STEPS}", *args.set],
                 WARMUP_STEPS, None, home)
    for r in range(args.repeats):
        # Alternate the order, so a load that drifts over the repeats hits every variant alike.
        order = ["reference", *variants] if r % 2 == 0 else [*reversed(variants), "reference"]
        for name in order:
            if name == "reference":
                load0 = os.getloadavg()[0]
                ref = reference_run([f"run_dir={out_dir}/reference", *common])
                refs.append({**ref, "load": [round(load0, 2), round(os.getloadavg()[0], 2)]})
            else:  # repeat 0 runs the reference first: its weights are there to compare
                runs[name].append({"overrides": variants[name], **flexmarl_run(
                    train, api, variants[name], steps, str(out_dir / "reference"), home)})
            print(f"repeat {r}: {name} done (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    ref_s = statistics.median(x["wall_s"] for x in refs)

    def summary(rs: list[dict]) -> dict:
        flex_s = _median(rs, "wall_s")
        assert flex_s is not None
        return {
            "flexmarl_s": flex_s, "ratio": ref_s / flex_s, "ops": rs[0]["ops"],
            "bookkeeping_cpu_ms_per_op": {k: _median(rs, "bookkeeping_cpu_ms_per_op", k)
                                          for k in ("flow", "worker", "total")},
            "dispatch_ms_p50": _median(rs, "dispatch_ms_p50"), "dispatch_ms_p99": _median(rs, "dispatch_ms_p99"),
            "prefect_overhead_frac": _median(rs, "prefect_overhead_frac"),
            "server_cpu_ms_per_op": _median(rs, "server_cpu_ms_per_op"),
            "final_weights_max_abs_diff": max(x["final_weights_max_abs_diff"] for x in rs),
            "s_per_step": flex_s / steps,
        }

    res = {"config": CONFIG, "steps": steps, "repeats": args.repeats, "api": args.api, "reference_s": ref_s,
           "reference_cpu_s": statistics.median(x["cpu_s"] for x in refs),
           **summary(runs["flexmarl"]),
           "baseline": summary(runs["baseline"]) if "baseline" in runs else None,
           "runs": {"reference": refs, **runs}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"\nload average (1 min) over the runs: {[x['load'] for x in refs]} (reference), "
          f"{[x.get('load') for rs in runs.values() for x in rs]} (flexmarl)")
    print(f"reference: {ref_s:.1f} s wall, {res['reference_cpu_s']:.1f} s CPU, {ref_s / steps:.3f} s per step")
    failed = False
    for name in variants:
        v = res if name == "flexmarl" else res["baseline"]
        bk = v["bookkeeping_cpu_ms_per_op"]
        srv = v["server_cpu_ms_per_op"]
        print(f"{name}: {v['flexmarl_s']:.1f} s ({v['s_per_step']:.3f} s per step), ratio {v['ratio']:.3f} over "
              f"{v['ops']} ops; bookkeeping CPU per op: flow {bk['flow']:.1f} + worker {bk['worker']:.1f} = "
              f"{bk['total']:.1f} ms" + (f"; Prefect server {srv:.1f} ms" if srv is not None else "")
              + f"; dispatch p50 {v['dispatch_ms_p50']:.1f} ms, p99 {v['dispatch_ms_p99']:.1f} ms; "
              f"bookkeeping share {100 * v['prefect_overhead_frac']:.1f}%; "
              f"weights differ by at most {v['final_weights_max_abs_diff']:.2g}")
        failed = failed or v["final_weights_max_abs_diff"] > 1e-4
    if failed:
        print("final weights differ from the reference's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
