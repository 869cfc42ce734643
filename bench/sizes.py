"""Real model sizes: the three-agent team (`configs/tiny.yaml`'s planner -> solver -> verifier)
at `tiny-10m`, `tiny-50m` and the `small-0.5b` preset (Qwen2.5-0.5B's shape), trained through
`flexmarl train` on one worker whose memory the plan (`flexmarl_core/control/memory.py`) sizes.

    python bench/sizes.py --json OUT [--quick] [--iterations N] [--memory-limit 19GiB]

Per preset, a co-design run and a sync run (every `codesign` switch off; at `small-0.5b` all
but `on_demand_allocation`, without which the plan refuses it) of a few iterations,
4 problems x 2 samples each, from random weights (what is measured is memory and speed, not
accuracy); at `small-0.5b` also the LoRA variant (three rank-8 adapters on one shared base).
The worker's memory limit is the same for every preset: the tiny teams fit with every trainer
state resident; the 0.5B team fits only with one resident, so it runs with the others swapped
out to the run folder, and the same team with every state resident (`resident_trainers: 3`) is
refused by the plan before it starts (`resident_all_refused`, its message).

Per run: `peak_rss_gib` (the worker's peak resident memory over its ops), `planned_gib` (the
plan's need at the resident count it ran with) and `plan_over_peak` (target within 20%:
0.8-1.2), swap-out and swap-in seconds and GB/s against `copy_gbps_write` / `copy_gbps_read`
(a plain file write and read of the same bytes in the run folder, page cache as a swap's),
`rollout_tokens_per_s` (sampled tokens over rollout op seconds), `step_s` (an optimizer step's
seconds, swap-in excluded) and `e2e_s_per_iteration`. Per preset: `speedup` (sync E2E over
co-design E2E) and `speedup_bound` (sync E2E over the floor of the sync run's ops on the
co-design's graph on one worker, `flexmarl_core/analysis/bound.py`), as for the other teams.

`--quick`: `tiny-10m` and `tiny-50m` only, 2 iterations. Weights, trainer states and the store
of each run are deleted once its figures are read (the 0.5B run writes ~6 GB per state).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from flexmarl_core.analysis import bound
from flexmarl_core.config import ConfigError, load_config
from flexmarl_core.config.codesign import SWITCHES, switch_overrides
from flexmarl_core.control import memory

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "tiny.yaml"
AGENTS = ("planner", "solver", "verifier")
SMALL = ["batch.inputs_per_iteration=4", "batch.micro_batch_inputs=2", "batch.group_size=2",
         "train.warm_start=none", "train.evaluate=false", "train.evaluate_initial=false"]
GIB = 1 << 30


def worker(limit: str, resident: int | None = None) -> str:
    extra = f", resident_trainers: {resident}" if resident else ""
    return f"cluster.workers=[{{name: w0, resources: {{rollout: 1, train: 1}}, memory_limit: {limit}{extra}}}]"


def model(preset: str, lora: bool) -> list[str]:
    spec = f"{{base: {preset}, lora: {{rank: 8}}}}" if lora else f"{{preset: {preset}}}"
    return [f"team.agents.{a}.model={spec}" for a in AGENTS]


def plain_copy(nbytes: int, folder: Path) -> tuple[float, float]:
    """GB/s of writing then reading `nbytes` in one file in `folder` (not fsynced: page cache)."""
    buf = np.ones(max(nbytes, 1), dtype=np.uint8)
    path = folder / "plain-copy.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(buf))
    t1 = time.perf_counter()
    with open(path, "rb") as f:
        back = f.read()
    t2 = time.perf_counter()
    assert len(back) == nbytes
    path.unlink()
    return nbytes / (t1 - t0) / 1e9, nbytes / (t2 - t1) / 1e9


def figures(run_dir: Path, cfg: Any, summary: dict) -> dict:
    ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    w = memory.plan(cfg)[1][0]
    peak = max(o.get("peak_rss", 0) for o in ops)
    rollouts = [o for o in ops if o["kind"] == "rollout"]
    steps = [o["t_end"] - o["t_start"] - o.get("swap_in_s", 0.0) for o in ops if o["kind"] == "step"]
    out_b, out_s = sum(o.get("swap_out_bytes", 0.0) for o in ops), sum(o.get("swap_out_s", 0.0) for o in ops)
    in_b, in_s = sum(o.get("swap_in_bytes", 0.0) for o in ops), sum(o.get("swap_in_s", 0.0) for o in ops)
    res = {
        "peak_rss_gib": peak / GIB, "planned_gib": w.planned / GIB, "plan_over_peak": w.planned / peak,
        "resident": w.resident, "swap_out_s": out_s, "swap_out_gb": out_b / 1e9,
        "swap_out_gbps": out_b / out_s / 1e9 if out_s else None,
        "swap_in_s": in_s, "swap_in_gb": in_b / 1e9, "swap_in_gbps": in_b / in_s / 1e9 if in_s else None,
        "rollout_tokens_per_s": sum(o["tokens"] for o in rollouts) / sum(o["t_end"] - o["t_start"] for o in rollouts),
        "step_s": statistics.median(steps), "e2e_s_per_iteration": summary["e2e_s_per_iteration"],
    }
    state = max((o.get("swap_out_bytes", 0.0) for o in ops), default=0.0)
    if state:
        res["copy_gbps_write"], res["copy_gbps_read"] = plain_copy(int(state), run_dir)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny-10m and tiny-50m, 2 iterations")
    ap.add_argument("--presets", nargs="*", default=None)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--memory-limit", default="19GiB", help="the one worker's memory_limit")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-sizes"))
    args = ap.parse_args()
    presets = args.presets or (["tiny-10m", "tiny-50m"] if args.quick else ["tiny-10m", "tiny-50m", "small-0.5b"])

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import ensure_api
    from flows.train import train

    api, _ = ensure_api()
    out: dict[str, Any] = {"iterations": args.iterations, "memory_limit": args.memory_limit, "presets": {}}
    t0 = time.time()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        for preset in presets:
            modes = {"codesign": [], "sync": switch_overrides(off=SWITCHES)}
            if preset == "small-0.5b":
                # It fits only with trainer states swapped out, which needs on-demand allocation:
                # its sync baseline keeps that one switch (the plan refuses the run without it).
                modes["sync"] = switch_overrides(off=[s for s in SWITCHES if s != "on_demand_allocation"])
                modes["lora"] = []
            row: dict[str, Any] = {}
            for mode, extra in modes.items():
                run_dir = Path(args.out) / f"{preset}-{mode}"
                over = [*SMALL, f"run_dir={run_dir}", f"train.iterations={args.iterations}",
                        worker(args.memory_limit), *model(preset, mode == "lora"), *extra]
                cfg = load_config(BASE, over)
                load = os.getloadavg()[0]
                state = train(str(BASE), over, progress=False, overwrite=True, return_state=True)
                if not state.is_completed():
                    print(f"{preset} {mode} failed: {state.message}", file=sys.stderr)
                    return 1
                row[mode] = {**figures(run_dir, cfg, state.result()["summary"]), "load": [load, os.getloadavg()[0]]}
                print(f"{preset:11s} {mode:8s} peak {row[mode]['peak_rss_gib']:.2f} GiB (plan "
                      f"{row[mode]['planned_gib']:.2f}), rollout {row[mode]['rollout_tokens_per_s']:.1f} tok/s, "
                      f"step {row[mode]['step_s']:.2f} s, {row[mode]['e2e_s_per_iteration']:.1f} s/it", flush=True)
                for heavy in ("weights", "trainers", "bases", "store"):
                    shutil.rmtree(run_dir / heavy, ignore_errors=True)
            cd, sy = Path(args.out) / f"{preset}-codesign", Path(args.out) / f"{preset}-sync"
            floor = bound.analyse(cd, 1, durations_from=sy, search=False)["floor_s"]
            sync_e2e = bound.analyse(sy, 1, search=False)["e2e_s"]
            row["speedup"] = row["sync"]["e2e_s_per_iteration"] / row["codesign"]["e2e_s_per_iteration"]
            row["speedup_bound"] = sync_e2e / floor
            if preset == "small-0.5b":
                try:
                    memory.check(load_config(BASE, [*SMALL, worker(args.memory_limit, 3), *model(preset, False)]))
                    row["resident_all_refused"] = False
                except ConfigError as e:
                    row["resident_all_refused"], row["resident_all_message"] = True, str(e).splitlines()[0]
            out["presets"][preset] = row
    out["bench_wall_s"] = time.time() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\n{'preset':11s} {'mode':8s} {'peak GiB':>9s} {'plan/peak':>9s} {'swap in GB/s':>12s} "
          f"{'copy GB/s':>9s} {'tok/s':>7s} {'step s':>7s} {'s/it':>7s}")
    for preset, row in out["presets"].items():
        for mode in ("codesign", "sync", "lora"):
            if mode in row:
                r = row[mode]
                gbps = f"{r['swap_in_gbps']:.2f}" if r["swap_in_gbps"] else "-"
                copy = f"{r['copy_gbps_read']:.2f}" if "copy_gbps_read" in r else "-"
                print(f"{preset:11s} {mode:8s} {r['peak_rss_gib']:9.2f} {r['plan_over_peak']:9.2f} {gbps:>12s} "
                      f"{copy:>9s} {r['rollout_tokens_per_s']:7.1f} {r['step_s']:7.2f} {r['e2e_s_per_iteration']:7.1f}")
        print(f"{preset:11s} speedup {row['speedup']:.2f} (bound {row['speedup_bound']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
