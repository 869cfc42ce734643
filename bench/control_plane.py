"""Control-plane cost: how long load monitoring and one scaling decision take.

The orchestrator runs `InstanceBalancer.monitor` (queued seconds per instance, per agent) and
`decide` (which worker moves from which agent to which) before each submission wave, on its
own thread of control, so their cost adds directly to dispatch latency. The paper reports
380-610 us per monitoring pass and 50-100 us per decision.

    python bench/control_plane.py --json runs/bench/control_plane.json [--quick]

Scenarios: the default team on this machine (3 agents, 2 workers) and cluster shapes up to
32 agents on 256 workers, with a skewed queue (one hot agent) so `decide` does real work and
returns a move. JSON: `monitor_us`, `decision_us` (the largest scenario's medians: the
worst case), plus per-scenario rows.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from flexmarl_core.control import InstanceBalancer


def scenario(n_agents: int, n_workers: int, seed: int = 0) -> tuple[InstanceBalancer, dict, dict, dict]:
    rng = random.Random(seed)
    agents = [f"agent{i}" for i in range(n_agents)]
    bal = InstanceBalancer(agents, threshold=2.0, weight_bytes={a: 4_000_000 for a in agents})
    for a in agents:
        for _ in range(5):
            bal.observe(a, rng.uniform(0.5, 3.0))
    workers = [f"tcp://10.0.{i // 250}.{i % 250}:8786" for i in range(n_workers)]
    # Round-robin instances, every agent at least one; agent0 is hot, the rest lightly queued.
    instances: dict[str, list[str]] = {a: [] for a in agents}
    for i in range(max(n_agents, n_workers)):  # fewer workers than agents: they host several
        instances[agents[i % n_agents]].append(workers[i % n_workers])
    queued = {a: rng.randint(0, 2) for a in agents}
    queued[agents[0]] = 8 * max(1, len(instances[agents[0]]))
    worker_load = {w: float(rng.randint(0, 3)) for w in workers}
    return bal, queued, instances, worker_load


def time_us(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    reps = 200 if args.quick else 2000
    shapes = [(3, 2), (8, 32), (16, 128), (32, 256)]
    rows = []
    for n_agents, n_workers in shapes:
        bal, queued, instances, worker_load = scenario(n_agents, n_workers)
        loads = bal.monitor(queued, instances)
        move = bal.decide(loads, instances, queued, worker_load)
        assert move is not None and move[1] == "agent0", f"{n_agents}x{n_workers}: no move to the hot agent"
        mon = time_us(lambda b=bal, q=queued, i=instances: b.monitor(q, i), reps)
        dec = time_us(lambda b=bal, lo=loads, i=instances, q=queued, w=worker_load: b.decide(lo, i, q, w), reps)
        rows.append({"agents": n_agents, "workers": n_workers,
                     "monitor_us": statistics.median(mon), "monitor_p99_us": sorted(mon)[int(0.99 * reps)],
                     "decision_us": statistics.median(dec), "decision_p99_us": sorted(dec)[int(0.99 * reps)]})
    print(f"{'agents':>6s} {'workers':>7s} {'monitor us':>11s} {'p99':>7s} {'decide us':>10s} {'p99':>7s}")
    for r in rows:
        print(f"{r['agents']:6d} {r['workers']:7d} {r['monitor_us']:11.1f} {r['monitor_p99_us']:7.1f} "
              f"{r['decision_us']:10.1f} {r['decision_p99_us']:7.1f}")
    worst = rows[-1]
    res = {"monitor_us": worst["monitor_us"], "decision_us": worst["decision_us"],
           "monitor_us_default_team": rows[0]["monitor_us"], "decision_us_default_team": rows[0]["decision_us"],
           "paper_monitor_us": [380, 610], "paper_decision_us": [50, 100], "rows": rows}
    print(f"worst shape {worst['agents']} agents x {worst['workers']} workers: monitor "
          f"{res['monitor_us']:.1f} us (paper 380-610), decision {res['decision_us']:.1f} us (paper 50-100)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
