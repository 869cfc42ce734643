"""Benchmark of the MEG Store's micro-batch path: write one micro-batch, read it back.

What it measures, per micro-batch of ``--mb-size`` samples (token lists of ~128 ids for
prompt and response, text, logprobs), through the public ``storage.MEGStore`` API:

* ``write``: ``write_samples(agent, iteration, rows)`` from Python dicts, as rollout does;
* ``read``: ``read_samples(agent, iteration, mb=mb)``, the query the trainer runs, against a
  partition that already holds a whole realistic iteration (``--prefill`` micro-batches,
  several hundred samples) plus the micro-batches written so far, with status fragments;
* ``status+ready``: ``write_status`` of the micro-batch's rewards, then
  ``ready(agent, iteration, mb=mb)`` (reported separately);
* once per iteration: reading the whole partition, and compacting it.

Prints a table and writes JSON (``write_read_p50_ms``, ``write_read_p99_ms``, ``rows_per_s``
and more). Not a test. Usage::

    python bench/store.py --json /tmp/store.json [--quick] [--uri DIR_OR_S3_URI]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from storage import MEGStore

AGENT = "solver"
G = 4  # trajectories per input; a micro-batch holds mb_size / G whole inputs
WORDS = ["the", "sum", "of", "x", "is", "42", "so", "we", "add", "carry", "answer", "step"]


def make_rows(rng: random.Random, iteration: int, mb: int, mb_size: int) -> list[dict]:
    rows = []
    for k in range(mb_size // G):
        input_id = f"it{iteration}-in{mb * (mb_size // G) + k}"
        prompt_ids = [rng.randrange(32_000) for _ in range(rng.randint(96, 160))]
        prompt_text = " ".join(rng.choice(WORDS) for _ in range(len(prompt_ids)))
        for g in range(G):
            n = rng.randint(96, 160)
            rows.append(
                {
                    "input_id": input_id,
                    "traj": g,
                    "turn": 0,
                    "mb": mb,
                    "policy_version": iteration,
                    "parents": [f"{input_id}:{g}:planner:0"],
                    "prompt_ids": prompt_ids,
                    "response_ids": [rng.randrange(32_000) for _ in range(n)],
                    "logprobs": [-rng.random() * 3 for _ in range(n)],
                    "prompt_text": prompt_text,
                    "response_text": " ".join(rng.choice(WORDS) for _ in range(n)),
                }
            )
    return rows


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run(uri: str, iterations: int, prefill: int, measured: int, mb_size: int) -> dict:
    store = MEGStore(uri)
    rng = random.Random(0)
    writes, reads, status_ready, full_reads, compacts, cpu = [], [], [], [], [], []
    fragments_seen = 0
    for it in range(iterations):
        batches = [make_rows(rng, it, mb, mb_size) for mb in range(prefill + measured)]
        # A realistic partition: a whole iteration's worth of micro-batches, half of them
        # already rewarded.
        for mb in range(prefill):
            store.write_samples(AGENT, it, batches[mb])
            if mb % 2 == 0:
                store.write_status(
                    AGENT,
                    it,
                    [
                        {
                            "sample_id": f"{r['input_id']}:{r['traj']}:{AGENT}:{r['turn']}",
                            "policy_version": it,
                            "mb": mb,
                            "reward": 1.0,
                        }
                        for r in batches[mb]
                    ],
                )
        for mb in range(prefill, prefill + measured):
            c0, t0 = time.process_time(), time.perf_counter()
            store.write_samples(AGENT, it, batches[mb])
            t1 = time.perf_counter()
            got = store.read_samples(AGENT, it, mb=mb)
            t2, c2 = time.perf_counter(), time.process_time()
            if got.num_rows != mb_size:
                raise RuntimeError(f"read {got.num_rows} rows of mb {mb}, wrote {mb_size}")
            status = [
                {"sample_id": s, "policy_version": it, "mb": mb, "reward": float(i % 2)}
                for i, s in enumerate(got.column("sample_id").to_pylist())
            ]
            t3 = time.perf_counter()
            store.write_status(AGENT, it, status)
            ready = store.ready(AGENT, it, mb=mb)
            t4 = time.perf_counter()
            if ready.num_rows != mb_size:
                raise RuntimeError(f"ready gave {ready.num_rows} rows of mb {mb}")
            cpu.append(c2 - c0)
            writes.append(t1 - t0)
            reads.append(t2 - t1)
            status_ready.append(t4 - t3)
        files = store.dataset("samples").files
        fragments_seen = max(fragments_seen, sum(f"/iteration={it}/" in f for f in files))
        t0 = time.perf_counter()
        whole = store.read_samples(AGENT, it)
        full_reads.append(time.perf_counter() - t0)
        if whole.num_rows != (prefill + measured) * mb_size:
            raise RuntimeError(f"partition read gave {whole.num_rows} rows")
        t0 = time.perf_counter()
        store.compact(AGENT, it)
        compacts.append(time.perf_counter() - t0)
        if store.read_samples(AGENT, it).num_rows != whole.num_rows:
            raise RuntimeError("compaction changed the row count")
    both = [w + r for w, r in zip(writes, reads, strict=True)]
    ms = 1e3
    return {
        "write_read_p50_ms": statistics.median(both) * ms,
        "write_read_p99_ms": pct(both, 0.99) * ms,
        # The fastest tenth: what an idle machine gives (the p50 moves with other load).
        "write_read_p10_ms": pct(both, 0.10) * ms,
        "rows_per_s": mb_size * len(both) / sum(both),
        # CPU time of this process for write+read: less sensitive to a busy machine.
        "write_read_cpu_p50_ms": statistics.median(cpu) * ms,
        "write_p50_ms": statistics.median(writes) * ms,
        "write_p99_ms": pct(writes, 0.99) * ms,
        "read_p50_ms": statistics.median(reads) * ms,
        "read_p99_ms": pct(reads, 0.99) * ms,
        "status_ready_p50_ms": statistics.median(status_ready) * ms,
        "status_ready_p99_ms": pct(status_ready, 0.99) * ms,
        "partition_read_ms": statistics.median(full_reads) * ms,
        "partition_rows": (prefill + measured) * mb_size,
        "compact_ms": statistics.median(compacts) * ms,
        "micro_batches": len(both),
        "mb_size": mb_size,
        "iterations": iterations,
        "prefill_micro_batches": prefill,
        "max_sample_fragments_in_partition": fragments_seen,
        "fs": store.fs.type_name,
        "pyarrow": pa.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="write results here")
    p.add_argument("--quick", action="store_true", help="one iteration, fewer micro-batches")
    p.add_argument("--uri", default=None, help="store location (default: a temp dir)")
    p.add_argument("--mb-size", type=int, default=16)
    args = p.parse_args(argv)
    iterations, prefill, measured = (1, 32, 48) if args.quick else (4, 32, 96)
    tmp = None
    load0 = os.getloadavg()[0]
    uri = args.uri
    if uri is None:
        tmp = tempfile.mkdtemp(prefix="flexmarl-bench-store-")
        uri = tmp
    try:
        res = run(uri, iterations, prefill, measured, args.mb_size)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    res["quick"] = args.quick
    res["loadavg_1m_start_end"] = [load0, os.getloadavg()[0]]
    res["target_write_read_p50_ms"] = 6.7
    rows = [
        (
            "write+read p50 / p99 (ms)",
            f"{res['write_read_p50_ms']:.2f} / {res['write_read_p99_ms']:.2f}",
        ),
        ("write p50 / p99 (ms)", f"{res['write_p50_ms']:.2f} / {res['write_p99_ms']:.2f}"),
        ("read mb p50 / p99 (ms)", f"{res['read_p50_ms']:.2f} / {res['read_p99_ms']:.2f}"),
        (
            "status+ready p50 / p99 (ms)",
            f"{res['status_ready_p50_ms']:.2f} / {res['status_ready_p99_ms']:.2f}",
        ),
        ("write+read p10 (ms)", f"{res['write_read_p10_ms']:.2f}"),
        ("write+read CPU p50 (ms)", f"{res['write_read_cpu_p50_ms']:.2f}"),
        ("rows/s (write+read)", f"{res['rows_per_s']:,.0f}"),
        (f"partition read, {res['partition_rows']} rows (ms)", f"{res['partition_read_ms']:.1f}"),
        ("compact partition (ms)", f"{res['compact_ms']:.1f}"),
        ("micro-batches x size", f"{res['micro_batches']} x {res['mb_size']}"),
        ("max fragments in partition", str(res["max_sample_fragments_in_partition"])),
        ("filesystem", res["fs"]),
        (
            "load average 1 min (start, end)",
            ", ".join(f"{x:.1f}" for x in res["loadavg_1m_start_end"]),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"MEG Store micro-batch benchmark ({'quick' if args.quick else 'full'})")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    verdict = "ok" if res["write_read_p50_ms"] <= res["target_write_read_p50_ms"] else "SLOW"
    print(f"  target p50 <= {res['target_write_read_p50_ms']} ms: {verdict}")
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
