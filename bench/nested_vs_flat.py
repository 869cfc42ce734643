"""The price of a nested flow run per iteration: `bench/peer_trl.py`'s flexmarl side (the short
workload from its SFT start: ~10-token prompts, answers of a few tokens, many short iterations)
with `cluster.prefect_nested=true` and `false`, side by side in one invocation.

    python bench/nested_vs_flat.py --json OUT [--iterations 100] [--repeats 3] [--background 0]

Each repeat runs both layouts, the order alternating from one repeat to the next, same seed, on
a Prefect server of the bench's own (a new database, warmed by an unmeasured 3-iteration run)
left to go idle before each run. Per run: `wall_s` (the flow call), `run_wall_s` and
`s_per_iteration` (the run's own wall over its iterations), `step_s_median`, and the CPU seconds
in that time of the flow process (`flow_cpu_s`, the in-process Dask scheduler included), of its
threads by name (`threads_cpu_s`), of the Prefect server (`server_cpu_s`, children included)
and of the Dask worker processes (`workers_cpu_s`, sampled until they exit). Summary per layout:
medians over repeats (`step_s_p25`: each run's quietest quarter of iterations; `handoff_s`: the
mean time from an iteration's last op's end to the next one's first op's start), and `gap`, nested over flat `s_per_iteration` minus 1. `--server-nice N [M ...]`:
each layout runs with the bench's server (every thread of it) reniced to each N in turn
(flexmarl starts it at 10); the summary then has a layout per value (`nested@19`).
`--compare-set OVERRIDE` (repeatable): each layout also runs with that config override (e.g.
`cluster.worker_env.OMP_WAIT_POLICY=PASSIVE`), in the same alternating order; its runs and
summary are named `flat[OVERRIDE]`, and `stage_cpu_per_it_s` is the stages' CPU per iteration.
`--layouts flat` runs one layout only (no `gap` then).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _fresh import LoadSampler
from peer_trl import (
    CONFIG,
    WORKLOAD,
    background,
    provenance,
    run_flexmarl,
    server_cpu_s,
    settle,
    sft_start,
)

WARMUP_ITERATIONS = 3


class CpuSampler(threading.Thread):
    """CPU of this process's threads (by name) and of its child processes, sampled until
    stopped: a worker that exits keeps its last sample."""

    def __init__(self, every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.every, self._halt, self.me = every, threading.Event(), psutil.Process()
        self.children: dict[int, float] = {}
        self.threads: dict[int, tuple[str, float]] = {}
        self._base_children = self._sample_children()
        self._base_threads = {t.id: t.user_time + t.system_time for t in self.me.threads()}

    def _sample_children(self) -> dict[int, float]:
        out = {}
        for p in self.me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
        return out

    def _sample(self) -> None:
        self.children.update(self._sample_children())
        names = {t.native_id: t.name for t in threading.enumerate()}
        with contextlib.suppress(psutil.Error):
            for t in self.me.threads():
                old = self.threads.get(t.id, ("", 0.0))[0]
                self.threads[t.id] = (names.get(t.id) or old or "?", t.user_time + t.system_time)

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self._sample()

    def stop(self) -> tuple[float, dict[str, float]]:
        self._halt.set()
        self.join()
        self._sample()
        workers = sum(v - self._base_children.get(pid, 0.0) for pid, v in self.children.items())
        by_name: dict[str, float] = {}
        for tid, (name, cpu) in self.threads.items():
            key = "main" if name == "MainThread" else name.split("-")[0] if name.startswith("Thread-") else name
            by_name[key] = by_name.get(key, 0.0) + cpu - self._base_threads.get(tid, 0.0)
        return workers, {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 0.005}


def layout(nested: bool, nice: int | None, variant: str | None = None) -> str:
    return ("nested" if nested else "flat") + ("" if nice is None else f"@{nice}") + (f"[{variant}]" if variant else "")


def renice(home: Path, nice: int) -> None:
    """Every thread of the server started in `home` (Linux nice is per thread) to `nice`."""
    from flexmarl.servers import read_pid_file

    proc = psutil.Process(int((read_pid_file(home) or {})["pid"]))
    for p in [proc, *proc.children(recursive=True)]:
        for t in p.threads():
            os.setpriority(os.PRIO_PROCESS, t.id, nice)


def handoff_s(run_dir: Path) -> float | None:
    """Mean seconds from one iteration's last op's end to the next one's first op's start (the
    run's op log): the hand-off between iterations that look-ahead chains away."""
    from flexmarl_core.driver.metrics import log_lines
    from flexmarl_core.runfiles.location import as_location

    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for line in log_lines(as_location(run_dir), "ops.jsonl"):
        if line.strip():
            o = json.loads(line)
            it = o["iteration"]
            first[it] = min(first.get(it, o["t_start"]), o["t_start"])
            last[it] = max(last.get(it, o["t_end"]), o["t_end"])
    its = sorted(first)
    gaps = [max(0.0, first[b] - last[a]) for a, b in zip(its, its[1:], strict=False)]
    return statistics.fmean(gaps) if gaps else None


def one_run(train: object, api: str, home: Path, config: Path, ckpt: Path, base: list[str], run_dir: Path,
            iterations: int, nested: bool, bg: int) -> dict:
    waited = settle(home)
    sampler, load = CpuSampler(), LoadSampler(every=2.0)
    with background(bg, 0):
        load.start()
        sampler.start()
        srv0, c0 = server_cpu_s(home), time.process_time()
        figures, _ = run_flexmarl(train, api, config, [
            *base, f"run_dir={run_dir}", f"train.iterations={iterations}", f"train.init_from={ckpt}",
            "train.evaluate=false", f"train.checkpoint_every={iterations}",
            f"cluster.prefect_nested={'true' if nested else 'false'}"], run_dir, iterations)
        c1, srv1 = time.process_time(), server_cpu_s(home)
        workers, threads = sampler.stop()
        figures["load"] = load.stop()
    figures.pop("reward", None)
    steps = sorted(figures.pop("step_s"))
    # the quietest quarter of the iterations: the figure least moved by other load on the machine
    figures["step_s_p25"] = steps[len(steps) // 4]
    figures["handoff_s"] = handoff_s(run_dir)
    return {**figures, "nested": nested, "settle_s": waited, "s_per_iteration": figures["run_wall_s"] / iterations,
            "flow_cpu_s": c1 - c0, "server_cpu_s": None if srv0 is None or srv1 is None else srv1 - srv0,
            "workers_cpu_s": workers, "threads_cpu_s": threads}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--background", type=int, default=0, help="processes spinning beside each run")
    ap.add_argument("--server-nice", type=int, nargs="*", default=None, help="renice the bench's Prefect server")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (both layouts)")
    ap.add_argument("--compare-set", action="append", default=[],
                    help="an override each layout also runs with, alternating with the default (repeatable)")
    ap.add_argument("--layouts", nargs="+", choices=("nested", "flat"), default=["nested", "flat"])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "runs" / "bench-nested-vs-flat"))
    args = ap.parse_args()
    out = Path(args.out).resolve()

    from flexmarl.prefect_api import start_server, stop_server

    with contextlib.ExitStack() as stack:
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flexmarl-bench-prefect-")))
        stack.callback(stop_server, home)
        api = start_server(home)
        from flows.train import train

        base = [f"seed={args.seed}", *WORKLOAD, *args.set]
        ckpt, _ = sft_start(CONFIG, ["seed=0", *WORKLOAD, *args.set])
        run_flexmarl(train, api, CONFIG, [*base, f"run_dir={out}/warmup", f"train.init_from={ckpt}",
                                          f"train.iterations={WARMUP_ITERATIONS}", "train.evaluate=false"],
                     out / "warmup", WARMUP_ITERATIONS)
        res: dict = {"bench": "nested_vs_flat", "iterations": args.iterations, "repeats": args.repeats,
                     "seed": args.seed, "background": args.background,
                     "server_nice": args.server_nice, "overrides": base, "compare_sets": args.compare_set,
                     "layouts": args.layouts, **provenance(),
                     "load_before": Path("/proc/loadavg").read_text().split()[:3], "runs": [],
                     "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                     "start_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        nices = args.server_nice or [None]
        variants: list[str | None] = [None, *args.compare_set]
        combos = [(nested, nice, v) for nested in (True, False) if layout(nested, None) in args.layouts
                  for nice in nices for v in variants]
        for k in range(args.repeats):
            for nested, nice, v in (combos if k % 2 == 0 else combos[::-1]):
                if nice is not None:
                    renice(home, nice)
                tag = (f"r{k}-{'nested' if nested else 'flat'}" + ("" if nice is None else f"-nice{nice}")
                       + ("" if v is None else f"-v{variants.index(v)}"))
                r = one_run(train, api, home, CONFIG, ckpt, [*base, *([v] if v else [])], out / tag,
                            args.iterations, nested, args.background)
                r["repeat"], r["server_nice"], r["layout"], r["variant"] = k, nice, layout(nested, nice, v), v
                r["stage_cpu_per_it_s"] = None if r["stage_cpu_s"] is None else r["stage_cpu_s"] / args.iterations
                res["runs"].append(r)
                print(f"{tag}: {r['s_per_iteration']:.3f} s/it (wall {r['wall_s']:.1f} s), flow CPU "
                      f"{r['flow_cpu_s']:.1f} s, server {r['server_cpu_s']}, workers {r['workers_cpu_s']:.1f}, "
                      f"load {r['load']['mean']}; threads {r['threads_cpu_s']}", flush=True)
        med = statistics.median
        res["summary"] = s = {
            name: {key: med(r[key] for r in res["runs"] if r["layout"] == name)
                   for key in ("s_per_iteration", "wall_s", "step_s_median", "flow_cpu_s", "server_cpu_s",
                               "workers_cpu_s", "stage_cpu_s", "stage_cpu_per_it_s", "step_s_p25")}
            | {"handoff_s": med([r["handoff_s"] for r in res["runs"] if r["layout"] == name
                                   and r["handoff_s"] is not None] or [None])}
            for name in dict.fromkeys(r["layout"] for r in res["runs"])}
        for nice in nices:
            for v in variants:
                if layout(True, nice, v) in s and layout(False, nice, v) in s:
                    nested, flat = s[layout(True, nice, v)], s[layout(False, nice, v)]
                    s["gap" + ("" if nice is None else f"@{nice}") + (f"[{v}]" if v else "")] = (
                        nested["s_per_iteration"] / flat["s_per_iteration"] - 1)
        for name in list(s):  # each override against the default of its layout
            base_name = name.split("[", 1)[0]
            if "[" in name and not name.startswith("gap") and base_name in s:
                s[name]["ratio_to_default"] = s[name]["s_per_iteration"] / s[base_name]["s_per_iteration"]
        res["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
        res["load"] = {"mean": round(statistics.fmean(r["load"]["mean"] for r in res["runs"]), 2)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
