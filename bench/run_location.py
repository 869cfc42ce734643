"""The same small run with its folder (config, weights, checkpoints, op log, store) on local
disk and on S3 (moto on loopback), through the real stack (Prefect flow, flexmarl's local Dask
cluster), alternating the two so machine noise hits both alike.

    .venv/bin/python bench/run_location.py --json runs/bench/run_location.json [--repeats 2]

Reports the flow's wall time, E2E seconds per iteration and the seconds of the IO-heavy stages
(sync publishes weights, step writes the trainer checkpoint) for each location, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench-runs"


def _stage_s(run_dir: str) -> dict[str, float]:
    from flexmarl_core.driver.metrics import log_lines
    from flexmarl_core.runfiles.location import RunLocation

    out: dict[str, float] = {}
    for line in log_lines(RunLocation(run_dir), "ops.jsonl"):
        r = json.loads(line)
        out[r["kind"]] = out.get(r["kind"], 0.0) + r["t_end"] - r["t_start"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=2)
    args = ap.parse_args()

    from tests._s3 import start_s3

    server = start_s3(BUCKET)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import ensure_api

    api, _ = ensure_api()
    from flows.train import train

    tag = uuid.uuid4().hex[:6]
    where = {"local": str(REPO / "runs" / "bench-location" / "{name}"), "s3": f"s3://{BUCKET}/{tag}/{{name}}"}
    runs: dict[str, list[dict]] = {k: [] for k in where}
    with temporary_settings(updates={PREFECT_API_URL: api}):
        for rep in range(args.repeats):
            order = list(where) if rep % 2 == 0 else list(reversed(where))
            for kind in order:
                overrides = [f"run_dir={where[kind]}-{rep}", f"train.iterations={args.iterations}",
                             "train.evaluate=false"]
                t0 = time.perf_counter()
                state = train(args.config, overrides, progress=False, overwrite=True, return_state=True)
                wall = time.perf_counter() - t0
                if not state.is_completed():
                    print(f"{kind} rep {rep} failed: {state.message}", file=sys.stderr)
                    return 1
                s = state.result()["summary"]
                stages = _stage_s(s["run_dir"])
                row = {"flow_wall_s": wall, "e2e_s_per_iteration": s["e2e_s_per_iteration"],
                       "sync_s": stages.get("sync", 0.0), "step_s": stages.get("step", 0.0),
                       "rollout_s": stages.get("rollout", 0.0)}
                runs[kind].append(row)
                print(f"{kind:5s} rep {rep}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    server.stop()
    med = {k: {f: statistics.median(r[f] for r in rows) for f in rows[0]} for k, rows in runs.items()}
    out = {"config": args.config, "iterations": args.iterations, "repeats": args.repeats, "runs": runs,
           "median": med, "s3_over_local": {f: med["s3"][f] / med["local"][f] for f in med["local"]
                                            if med["local"][f] > 0}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["median"]), json.dumps(out["s3_over_local"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
