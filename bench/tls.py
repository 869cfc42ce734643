"""What TLS on every Dask connection (`cluster.security: auto`, flexmarl_core/cluster/security.py)
costs against plain tcp (`cluster.security: none`), side by side on the same machine.

Each repeat starts the default team's local cluster (configs/default.yaml: two one-thread worker
processes, w0 and w1) for each condition, both up at once, and measures on them, alternating
which goes first:

    dispatch   N trivial tasks submitted and gathered one at a time, in blocks of 20 taking turns
               between the clusters: the round trip client -> scheduler -> worker -> scheduler
               -> client (median and p90, ms) and this process's CPU per task (the schedulers
               and clients run here)
    transfer   a bytes payload of 4 MB and of 40 MB made by a task on w0 (finished before the
               clock starts), then a task on w1 that takes it: dispatch plus the worker-to-worker
               copy (seconds, median)
    run        the default team from random weights for a few iterations on each cluster in
               turn (the other idle) through the real stages and store (no Prefect;
               bench/e2e.py's work: 64 problems in four micro-batches): wall seconds per
               iteration, bookkeeping CPU per op (all CPU but the stages' own), and each op
               kind's median seconds from the run's op log (t_end - t_start, inside the worker)

An op's inputs and outputs go through the store, not Dask; only a sync's weight push inside the
op is a Dask broadcast (cluster/plugins.py). So TLS reaches a run mostly through dispatch and the
results' return: `tls_cost_per_op_ms` is the dispatch medians' difference, and `ratio_wall` the
run's (TLS over tcp wall per iteration, the median of each repeat's ratio: the machine's speed
drifts between repeats). On a loaded machine the two runs of a repeat also run at different
speeds; the ops' own seconds (which never wait on TLS) measure that, and `ratio_wall_net` is
the wall ratio over theirs (`ratio_op_s_per_repeat`): what is left for TLS.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/tls.py --json bench/results/tls.json \
        [--quick] [--repeats N] [--iterations N] [--tasks N]

Writes OUT and OUT's `.provenance.json` (commit, date, load before, during and after, machine).
`--quick`: one repeat, 100 tasks, 2 iterations (3 minutes on a loaded 2-core machine); the
default, 3 repeats of 300 tasks and 3 iterations, about 10.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from _fresh import load_now, provenance  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "default.yaml"
#: bench/e2e.py's work for the default team (random weights, 64 problems, four micro-batches),
#: without the held-out evaluation at the end (not part of an iteration)
WORK = ["train.warm_start=none", "train.evaluate_initial=false", "train.evaluate=false",
        "batch.inputs_per_iteration=64", "batch.micro_batch_inputs=16"]
CONDITIONS = {"tls": "auto", "tcp": "none"}
SIZES = {"4MB": 4 << 20, "40MB": 40 << 20}
#: transfers of each size per condition per repeat
TRANSFERS = 3
#: trivial tasks in a row on one cluster before the other's turn
BLOCK = 20


def _noop(i: int) -> int:
    return i


def _payload(n: int) -> bytes:
    return bytes(n)


def _take(b: bytes) -> int:
    return len(b)


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@contextmanager
def team_cluster(security: str, overrides: list[str]) -> Iterator[tuple[Any, Any, float]]:
    """`(config, client, seconds to start)`: the default team's local cluster with `security`."""
    from flexmarl_core.cluster import start_cluster
    from flexmarl_core.config import load_config

    cfg = load_config(str(CONFIG), [*overrides, f"cluster.security={security}"])
    t0 = time.perf_counter()
    cluster, client = start_cluster(cfg.cluster, dashboard=False)
    started = time.perf_counter() - t0
    try:
        yield cfg, client, started
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def dispatch(client: Any, n: int) -> tuple[list[float], float]:
    """Round-trip milliseconds of `n` trivial tasks, one at a time, and this process's CPU
    seconds meanwhile (the schedulers and clients live here)."""
    out, c0 = [], time.process_time()
    for i in range(n):
        t0 = time.perf_counter()
        client.submit(_noop, i, pure=False).result()
        out.append((time.perf_counter() - t0) * 1e3)
    return out, time.process_time() - c0


def transfer(client: Any, size: int) -> float:
    """Seconds from submitting the consumer on w1 to its result, the payload ready on w0."""
    from distributed import wait

    from flexmarl_core.cluster import workers_info

    info = workers_info(client)
    w0, w1 = sorted(info, key=lambda a: str(info[a]["name"]))
    made = client.submit(_payload, size, workers=[w0], pure=False)
    wait(made)  # made and held on w0; its bytes never come to this process
    t0 = time.perf_counter()
    got = client.submit(_take, made, workers=[w1], pure=False).result()
    elapsed = time.perf_counter() - t0
    assert got == size, (got, size)
    made.release()
    return elapsed


def op_seconds(run_dir: Path) -> dict[str, list[float]]:
    """Each op kind's seconds inside the worker, from the run's op log."""
    from flexmarl_core.analysis.bound import op_log

    out: dict[str, list[float]] = {}
    for r in op_log(run_dir):
        out.setdefault(r["kind"], []).append(r["t_end"] - r["t_start"])
    return out


def repeat(rep: int, args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    """Both conditions' clusters up at once; dispatch and transfers interleaved between them in
    blocks, then one run on each, one after the other (the other cluster idle meanwhile)."""
    from flexmarl_core import cluster as fcluster
    from flexmarl_core.driver import run

    order = list(CONDITIONS) if rep % 2 == 0 else list(CONDITIONS)[::-1]  # alternate who goes first
    rows = {c: {"condition": c, "repeat": rep, "dispatch_ms": [], "dispatch_flow_cpu_s": 0.0,
                "transfer_s": {k: [] for k in SIZES}} for c in CONDITIONS}
    with ExitStack() as stack:
        up = {}
        for c in order:
            overrides = [f"run_dir={out_dir}/{c}-{rep}", f"train.iterations={args.iterations}", *WORK]
            up[c] = stack.enter_context(team_cluster(CONDITIONS[c], overrides))
            rows[c]["cluster_start_s"] = up[c][2]
        for c in order:  # untimed: connections opened, the task path warm
            dispatch(up[c][1], 10)
            transfer(up[c][1], SIZES["4MB"])
        for b in range(max(args.tasks // BLOCK, 1)):
            for c in order if b % 2 == 0 else order[::-1]:
                ms, cpu = dispatch(up[c][1], BLOCK)
                rows[c]["dispatch_ms"] += ms
                rows[c]["dispatch_flow_cpu_s"] += cpu
        for i in range(TRANSFERS):
            for k, size in SIZES.items():
                for c in order if i % 2 == 0 else order[::-1]:
                    rows[c]["transfer_s"][k].append(transfer(up[c][1], size))
        for c in order:
            cfg, client, _ = up[c]
            folder = run.prepare_run(cfg, log=lambda _: None)
            load0 = load_now()
            res = run.train(cfg, folder, fcluster.DaskExecutor(client, str(folder)))
            s = res.summary()
            rows[c].update(wall_s_per_iteration=s["e2e_s_per_iteration"], ops=s["ops"],
                           bookkeeping_cpu_ms_per_op=1e3 * s["bookkeeping_cpu_s"] / s["ops"],
                           op_s=op_seconds(Path(folder)), load=[load0, load_now()])
    for c in order:
        r = rows[c]
        print(f"{c} rep {rep}: dispatch median {statistics.median(r['dispatch_ms']):.2f} ms, "
              f"p90 {quantile(r['dispatch_ms'], 0.9):.2f} ms; "
              + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in r["transfer_s"].items())
              + f"; run {r['wall_s_per_iteration']:.2f} s/it ({r['ops']} ops, bookkeeping "
              f"{r['bookkeeping_cpu_ms_per_op']:.1f} CPU-ms/op); start {r['cluster_start_s']:.1f} s; "
              f"load {r['load'][0]:.2f} -> {r['load'][1]:.2f}", flush=True)
    return [rows[c] for c in order]


def op_total(row: dict[str, Any]) -> float:
    return sum(sum(v) for v in row["op_s"].values())


def summarise(rows: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    by = {c: [r for r in rows if r["condition"] == c] for c in CONDITIONS}

    def pooled(c: str, key: str) -> list[float]:
        return [x for r in by[c] for x in r[key]]

    res: dict[str, Any] = {
        "dispatch_ms": {c: {"median": statistics.median(pooled(c, "dispatch_ms")),
                            "p90": quantile(pooled(c, "dispatch_ms"), 0.9), "n": len(pooled(c, "dispatch_ms")),
                            "flow_cpu_ms_per_task": 1e3 * sum(r["dispatch_flow_cpu_s"] for r in by[c])
                            / len(pooled(c, "dispatch_ms"))}
                        for c in CONDITIONS},
        "transfer_s": {k: {c: statistics.median(x for r in by[c] for x in r["transfer_s"][k]) for c in CONDITIONS}
                       for k in SIZES},
        "run": {c: {"wall_s_per_iteration": statistics.median(r["wall_s_per_iteration"] for r in by[c]),
                    "op_median_s": {k: statistics.median(x for r in by[c] for x in r["op_s"].get(k, []))
                                    for k in sorted({k for r in by[c] for k in r["op_s"]})},
                    "ops": by[c][0]["ops"],
                    "bookkeeping_cpu_ms_per_op": statistics.median(r["bookkeeping_cpu_ms_per_op"] for r in by[c]),
                    "cluster_start_s": statistics.median(r["cluster_start_s"] for r in by[c])}
                for c in CONDITIONS},
        "repeats": repeats,
    }
    res["tls_cost_per_op_ms"] = res["dispatch_ms"]["tls"]["median"] - res["dispatch_ms"]["tcp"]["median"]
    pairs = list(zip(by["tls"], by["tcp"], strict=True))
    res["tls_cost_per_op_ms_per_repeat"] = [statistics.median(t["dispatch_ms"]) - statistics.median(p["dispatch_ms"])
                                            for t, p in pairs]
    res["ratio_wall_per_repeat"] = [t["wall_s_per_iteration"] / p["wall_s_per_iteration"] for t, p in pairs]
    res["ratio_wall"] = statistics.median(res["ratio_wall_per_repeat"])
    # The ops' own seconds never wait on TLS, so their ratio is how much faster the machine ran
    # one run than the other; the wall ratio over it is what is left for TLS.
    res["ratio_op_s_per_repeat"] = [op_total(t) / op_total(p) for t, p in pairs]
    res["ratio_wall_net_per_repeat"] = [w / o for w, o in zip(res["ratio_wall_per_repeat"],
                                                               res["ratio_op_s_per_repeat"], strict=True)]
    res["ratio_wall_net"] = statistics.median(res["ratio_wall_net_per_repeat"])
    for k in SIZES:
        res["transfer_s"][k]["ratio"] = res["transfer_s"][k]["tls"] / res["transfer_s"][k]["tcp"]
    return res


def table(res: dict[str, Any]) -> str:
    d, t, r = res["dispatch_ms"], res["transfer_s"], res["run"]
    lines = [f"{'':34s} {'TLS':>10s} {'tcp':>10s} {'TLS / tcp':>10s}"]

    def row(label: str, a: float, b: float, fmt: str) -> None:
        lines.append(f"{label:34s} {a:10{fmt}} {b:10{fmt}} {a / b:10.2f}")

    row("dispatch round trip, median (ms)", d["tls"]["median"], d["tcp"]["median"], ".2f")
    row("dispatch round trip, p90 (ms)", d["tls"]["p90"], d["tcp"]["p90"], ".2f")
    row("  this process's CPU per task (ms)", d["tls"]["flow_cpu_ms_per_task"], d["tcp"]["flow_cpu_ms_per_task"], ".2f")
    for k in SIZES:
        row(f"{k} w0 -> w1 (s)", t[k]["tls"], t[k]["tcp"], ".3f")
    row("run wall per iteration (s)", r["tls"]["wall_s_per_iteration"], r["tcp"]["wall_s_per_iteration"], ".2f")
    for k in r["tls"]["op_median_s"]:
        if k in r["tcp"]["op_median_s"]:
            row(f"  {k} op median (s)", r["tls"]["op_median_s"][k], r["tcp"]["op_median_s"][k], ".3f")
    row("run bookkeeping CPU per op (ms)", r["tls"]["bookkeeping_cpu_ms_per_op"],
        r["tcp"]["bookkeeping_cpu_ms_per_op"], ".1f")
    row("cluster start (s)", r["tls"]["cluster_start_s"], r["tcp"]["cluster_start_s"], ".1f")
    lines.append(f"TLS cost per op: {res['tls_cost_per_op_ms']:+.2f} ms (per repeat "
                 + ", ".join(f"{x:+.2f}" for x in res["tls_cost_per_op_ms_per_repeat"])
                 + f"); wall per iteration TLS / tcp {res['ratio_wall']:.3f} (per repeat "
                 + ", ".join(f"{x:.3f}" for x in res["ratio_wall_per_repeat"]) + ")")
    lines.append("the ops' own seconds TLS / tcp per repeat "
                 + ", ".join(f"{x:.3f}" for x in res["ratio_op_s_per_repeat"])
                 + f"; wall ratio over it {res['ratio_wall_net']:.3f} (per repeat "
                 + ", ".join(f"{x:.3f}" for x in res["ratio_wall_net_per_repeat"]) + ")")
    return "\n".join(lines)


def uncommitted() -> dict[str, Any]:
    """What the tree holds beyond its commit: the tracked files changed and a hash of the diff
    (read only: no index refresh, so a concurrent git command in the checkout is not disturbed)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    names = subprocess.run(["git", "diff", "HEAD", "--name-only"], cwd=REPO, env=env, capture_output=True,
                           text=True).stdout.split()
    diff = subprocess.run(["git", "diff", "HEAD"], cwd=REPO, env=env, capture_output=True).stdout
    return {"uncommitted_files": len(names), "uncommitted_diff_sha256": hashlib.sha256(diff).hexdigest()[:16]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--iterations", type=int, default=None, help="of each run; default 3 (2 with --quick)")
    ap.add_argument("--tasks", type=int, default=None, help="timed trivial tasks per cluster; default 300 (100 with --quick)")
    ap.add_argument("--out", default="runs/bench-tls", help="the runs' folders")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    args.iterations = args.iterations or (2 if args.quick else 3)
    args.tasks = args.tasks or (100 if args.quick else 300)
    out_dir = Path(args.out).absolute()
    rows = []
    with provenance(REPO) as rec:
        rec.update(tree=str(REPO), **uncommitted())
        for rep in range(repeats):
            rows += repeat(rep, args, out_dir)
    rec.update(end_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               load_after=Path("/proc/loadavg").read_text().split()[:3])
    res = {"bench": "tls", "config": str(CONFIG.relative_to(REPO)), "work": WORK, "iterations": args.iterations,
           "tasks": args.tasks, "transfers": TRANSFERS, **summarise(rows, repeats), "provenance": rec, "rows": rows}
    print(table(res))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    # the sidecar's loads as the results pages quote them ("5.04 4.17 3.55"), as record.sh writes them
    side = {**rec, **{k: " ".join(rec[k]) for k in ("load_before", "load_after") if isinstance(rec.get(k), list)}}
    out.with_suffix(".provenance.json").write_text(json.dumps(side, indent=1))
    print(f"wrote {out} and {out.with_suffix('.provenance.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
