"""Benchmark of the sandbox's overhead on a benign program.

A trivial program (``def f(x): return x + 1``) with one test goes through
``flexmarl_core.sandbox.run_tests`` ``--n`` times one after another (one core: this is the
per-core rate, everything included: two interpreter starts, namespaces, limits, the call),
then ``--n`` times from one thread per core (the aggregate rate). Prints a line and writes
JSON: ``programs_per_s`` (per core), ``latency_p50_ms``, ``latency_p99_ms``,
``programs_per_s_all_cores`` and the ``protections`` that were on. Not a test. Usage::

    python bench/sandbox.py --json /tmp/sandbox.json [--n 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flexmarl_core.sandbox import Limits, protections, run_tests

CODE = "def f(x):\n    return x + 1\n"
TESTS = ["assert candidate(1) == 2"]


def one() -> float:
    t0 = time.perf_counter()
    v = run_tests(CODE, TESTS, Limits(), entry="f")
    if v.reason != "passed":
        raise SystemExit(f"the trivial program did not pass: {v}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="programs per phase")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the figures here")
    args = ap.parse_args()
    if args.n < 2:
        ap.error("--n must be >= 2")
    report = protections()
    one()  # warm the page cache
    t0 = time.perf_counter()
    lat = sorted(one() for _ in range(args.n))
    serial = time.perf_counter() - t0
    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=cores) as pool:
        list(pool.map(lambda _: one(), range(args.n)))
    parallel = time.perf_counter() - t0
    out = {
        "programs_per_s": args.n / serial,
        "latency_p50_ms": 1000 * statistics.median(lat),
        "latency_p99_ms": 1000 * lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        "programs_per_s_all_cores": args.n / parallel,
        "cores": cores,
        "n": args.n,
        "python": platform.python_version(),
        "protections": report,
    }
    print(f"sandbox: {out['programs_per_s']:.1f} programs/s per core, p50 "
          f"{out['latency_p50_ms']:.1f} ms, p99 {out['latency_p99_ms']:.1f} ms; "
          f"{out['programs_per_s_all_cores']:.1f} programs/s on {cores} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
