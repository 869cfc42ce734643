"""The orchestration floor: what flexmarl costs per op on fine-grained work.

    python bench/overhead.py --json runs/bench/overhead.json [--quick]

Runs `configs/overhead.yaml` (one agent, a 1.1M-parameter model, 8 prompts x G 8 completions
of at most 8 tokens per step, one worker with 2 torch threads; 5 ops per step) through the
training flow `flexmarl train` runs (Prefect flow, Dask worker, MEG Store), and, as the
reference, the same stage functions called in this process in a plain loop, same seed; both
must reach the same final weights. Keys: `flexmarl_s` and `reference_s` (the ops' wall time:
first op submitted to last op done; setup excluded in both), `ratio` (reference / flexmarl),
`ops`, `bookkeeping_cpu_ms_per_op` (flow process incl. the in-process Dask scheduler, and
worker, outside the stages), `dispatch_ms_p50` / `dispatch_ms_p99` (an op's last dependency's
end to its start, in the worker's clock), `prefect_overhead_frac` (bookkeeping share of CPU).
`--quick`: 60 steps instead of 500.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = str(REPO / "configs" / "overhead.yaml")


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
    from flexmarl_core import run
    from flexmarl_core.config import load_config
    from flexmarl_core.meg import MEG
    from flexmarl_core.plan import Plan
    from flexmarl_core.stages import run_stage

    cfg = load_config(CONFIG, overrides)
    run_dir = run.prepare_run(cfg, log=lambda _: None)
    plan = Plan.build(cfg, MEG.from_config(cfg.team))
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
    from flexmarl_core.worker import load_weights

    worst = 0.0
    for agent in agents:
        wa, wb = load_weights(a, agent, version), load_weights(b, agent, version)
        worst = max(worst, *((wa[k] - wb[k]).abs().max().item() for k in wa))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--quick", action="store_true", help="60 steps instead of 500")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--reference-only", default=None, help=argparse.SUPPRESS)  # JSON overrides
    args = ap.parse_args()
    if args.reference_only is not None:
        print(json.dumps(_reference(json.loads(args.reference_only))))
        return 0
    steps = args.steps or (60 if args.quick else 500)
    out_dir = REPO / "runs" / "bench-overhead"

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bench.e2e import server_cpu_s
    from flexmarl.prefect_api import ensure_api
    from flexmarl_core.config import load_config
    from flexmarl_core.meg import MEG
    from flexmarl_core.plan import Plan

    api, _ = ensure_api()
    from flows.train import train

    common = [f"train.iterations={steps}", *args.set]
    flex = [f"run_dir={out_dir}/flexmarl", *common]
    ref = reference_run([f"run_dir={out_dir}/reference", *common])
    srv0 = server_cpu_s()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        state = train(CONFIG, flex, progress=False, return_state=True)
    srv1 = server_cpu_s()
    if not state.is_completed():
        print(f"flexmarl run failed: {state.message}", file=sys.stderr)
        return 1
    s = state.result()["summary"]

    cfg = load_config(CONFIG, flex)
    plan = Plan.build(cfg, MEG.from_config(cfg.team))
    gaps = dispatch_ms(Path(s["run_dir"]), plan.deps)
    diff = max_weight_diff(s["run_dir"], ref["run_dir"], list(MEG.from_config(cfg.team).trainable_agents), steps)
    ops = s["ops"]
    res = {
        "config": CONFIG, "steps": steps, "ops": ops,
        "flexmarl_s": s["wall_s"], "reference_s": ref["wall_s"], "ratio": ref["wall_s"] / s["wall_s"],
        "bookkeeping_cpu_ms_per_op": {
            "flow": 1000 * s["flow_cpu_s"] / ops, "worker": 1000 * s["worker_bookkeeping_cpu_s"] / ops,
            "total": 1000 * (s["flow_cpu_s"] + s["worker_bookkeeping_cpu_s"]) / ops},
        "dispatch_ms_p50": statistics.median(gaps), "dispatch_ms_p99": pct(gaps, 0.99),
        "prefect_overhead_frac": s["prefect_overhead_frac"],
        "stage_cpu_s": s["stage_cpu_s"], "reference_cpu_s": ref["cpu_s"],
        "server_cpu_ms_per_op": (1000 * (srv1 - srv0) / ops) if srv0 is not None and srv1 is not None else None,
        "final_weights_max_abs_diff": diff,
        "s_per_step": {"flexmarl": s["wall_s"] / steps, "reference": ref["wall_s"] / steps},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    bk = res["bookkeeping_cpu_ms_per_op"]
    print(f"\n{'':28s} {'flexmarl':>10s} {'reference':>10s}")
    print(f"{'wall s (ops)':28s} {res['flexmarl_s']:10.1f} {res['reference_s']:10.1f}")
    print(f"{'s per step':28s} {res['s_per_step']['flexmarl']:10.3f} {res['s_per_step']['reference']:10.3f}")
    print(f"ratio (reference / flexmarl): {res['ratio']:.3f} over {ops} ops")
    print(f"bookkeeping CPU per op: flow {bk['flow']:.1f} ms + worker {bk['worker']:.1f} ms = {bk['total']:.1f} ms"
          + (f"; Prefect server {res['server_cpu_ms_per_op']:.1f} ms" if res["server_cpu_ms_per_op"] is not None else ""))
    print(f"dispatch (dependency end -> op start): p50 {res['dispatch_ms_p50']:.1f} ms, "
          f"p99 {res['dispatch_ms_p99']:.1f} ms")
    print(f"bookkeeping share of CPU: {100 * res['prefect_overhead_frac']:.1f}%; "
          f"final weights differ by at most {diff:.2g}")
    if diff > 1e-4:
        print("final weights differ from the reference's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
