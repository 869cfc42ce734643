"""Weight push to N instances of an agent: every instance reads the published object from S3,
against one Dask broadcast from the worker that ran the sync (what `cluster.push_weights` does:
`scatter(broadcast=True)` from inside the task, then Dask replicates the bytes peer to peer).

Both start once the sync has published the object (that PUT happens either way: it is what a
restarted worker reads) and end when every target worker holds the bytes in memory. S3 is moto
on loopback, so the S3 column is a lower bound of a real object store's latency; the workers are
local processes (loopback TCP), all on this machine's cores.

    .venv/bin/python bench/weight_push.py --json runs/bench/weight_push.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

BUCKET = "bench-push"


def _read_s3(key: str) -> int:
    """In a target worker: read the object whole (what `load_weights` does)."""
    from flexmarl_core.runfiles.location import RunLocation

    return len(RunLocation(f"s3://{BUCKET}").read_bytes(key))


def _broadcast(blob_key: str, targets: list[str]) -> float:
    """A task on the sync's worker: the broadcast `cluster.push_weights` runs, timed."""
    import distributed

    from flexmarl_core.runfiles.location import RunLocation

    blob = RunLocation(f"s3://{BUCKET}").read_bytes(blob_key)  # stands for the state in memory
    client = distributed.get_client()
    t0 = time.perf_counter()
    fut = client.scatter({f"push-{time.time_ns()}": blob}, workers=targets, broadcast=True, hash=False)
    elapsed = time.perf_counter() - t0
    fut.clear()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=4, help="worker processes: 1 sync + N-1 targets")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    sizes_mb = [4, 40] if args.quick else [4, 40, 160]
    reps = 2 if args.quick else args.reps

    from tests._s3 import start_s3

    server = start_s3(BUCKET)
    from distributed import Client, LocalCluster

    from flexmarl_core.cluster import workers_info
    from flexmarl_core.runfiles.location import RunLocation

    loc = RunLocation(f"s3://{BUCKET}")
    rows = []
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        addrs = sorted(workers_info(client))
        sync, targets = addrs[0], addrs[1:]
        for mb in sizes_mb:
            key = f"weights/agent/v{mb}.safetensors"
            loc.write_bytes(key, os.urandom(mb << 20))
            s3_s, bc_s = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                got = client.run(_read_s3, key, workers=targets)  # all targets at once
                s3_s.append(time.perf_counter() - t0)
                assert set(got.values()) == {mb << 20}
                bc_s.append(client.submit(_broadcast, key, targets, workers=[sync], pure=False).result())
            row = {"mb": mb, "targets": len(targets), "s3_read_all_s": statistics.median(s3_s),
                   "broadcast_s": statistics.median(bc_s)}
            row["s3_over_broadcast"] = row["s3_read_all_s"] / row["broadcast_s"]
            rows.append(row)
            print(json.dumps(row))
    server.stop()
    out = {"what": "weight push to N-1 workers: all read one S3 object vs one Dask broadcast (median of reps)",
           "workers": args.workers, "reps": reps, "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
