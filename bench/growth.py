"""Long runs: what a run costs per iteration as it grows, and what it leaves behind.

    python bench/growth.py --json OUT [--quick] [--iterations N] [--store-iterations M]

Three parts:

1. **A long `configs/tiny.yaml` run** through `flexmarl train` (Prefect flow, local Dask
   cluster), killed with SIGKILL halfway and finished with `flexmarl train --resume`, then
   audited (`flexmarl store audit`, `store check`, timed). After each iteration: the flow
   process's CPU seconds and RSS, the store's file count and bytes, the disk held by weights and
   trainer states, and the bytes the flow and its workers wrote (`/proc/<pid>/io`). Targets
   (under `targets` in the JSON): disk held bounded (the second half's median within 5% of the
   first half's; the largest of each half, a step in flight's moment, is reported too), flow RSS flat
   after warm-up (in the first attempt, its last tenth's median within 10% of its second
   tenth's; `flow_rss_kb_per_op` says the growth per op, which decides longer runs), store
   files per iteration bounded (compaction), and each iteration's Prefect graph (its nested flow
   run's task runs) far below the server's 10,000.
2. **A synthetic store history**: the tiny team's traffic (inputs, 3 agents x 2 micro-batches
   of samples, rewards, consumption) through `storage.MEGStore` for M iterations, with the
   run's compaction after each iteration and without: files, and `audit_store` / `check_store`
   seconds at the end (both are linear in the store; compaction makes them linear in
   partitions instead of fragments).
3. **The op log on S3** (moto, the test suite's object store): `MetricsWriter` uploading after
   every op. Bytes per upload at 1k, 5k and 10k ops, against what a whole-file upload sends
   at that point (the file's size). Target: flat.

`--quick`: 60 iterations, 200 store iterations, 3k ops (a few minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
MB = 1e6


def _bytes(folder: Path) -> tuple[int, int]:
    """Files and bytes under `folder`."""
    n = size = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                size += os.path.getsize(os.path.join(root, f))
                n += 1
            except OSError:
                pass
    return n, size


def _written(pid: int) -> int | None:
    """Bytes written to storage by `pid` and its children (their /proc io counters)."""
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
        return sum(q.io_counters().write_bytes for q in procs)
    except (psutil.Error, AttributeError):
        return None


class Sampler(threading.Thread):
    """After each new line of `iterations.jsonl`, a sample of the flow process `pid` and the
    run folder."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.pid, self.rows = run_dir, 0, []
        self.written0 = 0  # the killed attempt's writes, carried over
        self.stop = threading.Event()

    def run(self) -> None:
        log = self.run_dir / "metrics" / "iterations.jsonl"
        seen = 0
        while not self.stop.is_set():
            try:
                lines = log.read_text().splitlines() if log.exists() else []
            except OSError:
                lines = []
            if len(lines) > seen and self.pid:
                try:
                    proc = psutil.Process(self.pid)
                    cpu, rss = sum(proc.cpu_times()[:2]), proc.memory_info().rss
                except psutil.Error:
                    time.sleep(0.1)
                    continue
                files, size = _bytes(self.run_dir / "store")
                held = sum(_bytes(self.run_dir / d)[1] for d in ("weights", "trainers"))
                wrote = _written(self.pid)
                for line in lines[seen:]:
                    it = json.loads(line)["iteration"]
                    self.rows.append({"iteration": it, "flow_cpu_s": cpu, "flow_rss_mb": rss / MB,
                                      "store_files": files, "store_mb": size / MB,
                                      "weights_trainers_mb": held / MB, "pid": self.pid,
                                      "written_mb": None if wrote is None else (self.written0 + wrote) / MB})
                seen = len(lines)
            time.sleep(0.05)


def _cli(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def long_run(out: Path, iterations: int, api: str) -> dict[str, Any]:
    run_dir = out / "long"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(str(run_dir) + ".faults", ignore_errors=True)
    env = {**os.environ, "PREFECT_API_URL": api, "PYTHONPATH": str(REPO)}
    sets = [f"run_dir={run_dir}", f"train.iterations={iterations}", "train.evaluate=false", "cluster.prefect_lean=true"]
    sampler = Sampler(run_dir)
    sampler.start()
    t0 = time.time()
    first = _cli(["train", str(TINY), *[x for s in sets for x in ("--set", s)], "--no-progress", "--overwrite"], env)
    sampler.pid = first.pid
    log = run_dir / "metrics" / "iterations.jsonl"
    kill_at = iterations // 2
    while first.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= kill_at:
            break
        time.sleep(0.2)
    if first.poll() is not None:
        raise SystemExit(f"the run ended before the kill: {first.stdout.read() if first.stdout else ''}")
    sampler.written0 = (_written(first.pid) or 0)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    killed_after = len(log.read_text().splitlines())
    resumed = _cli(["train", "--resume", str(run_dir), "--no-progress"], env)
    sampler.pid = resumed.pid
    text, _ = resumed.communicate()
    wall = time.time() - t0
    time.sleep(0.5)
    sampler.stop.set()
    sampler.join()
    if resumed.returncode != 0:
        raise SystemExit(f"the resumed run failed:\n{text[-3000:]}")
    timings = {}
    for cmd in ("audit", "check"):
        t = time.perf_counter()
        target = str(run_dir) if cmd == "audit" else str(run_dir / "store")
        done = subprocess.run([sys.executable, "-m", "flexmarl.cli", "store", cmd, target], cwd=REPO, env=env,
                              capture_output=True, text=True)
        timings[f"store_{cmd}_s"] = time.perf_counter() - t
        timings[f"store_{cmd}_ok"] = done.returncode == 0
    rows = sampler.rows
    from flexmarl_core.config import load_config
    from flexmarl_core.orchestrator.plan import Plan

    sizes = Plan.build(load_config(TINY, [f"train.iterations={iterations}"])).sizes()
    ops = sum(sizes.values())
    return {"iterations": iterations, "killed_after_iterations": killed_after, "wall_s": wall,
            "ops": ops, "max_task_runs_per_flow_run": max(sizes.values()), **timings, "rows": rows}


def _tiny_rows(it: int, agent: str, mb: int, parents: list[str]) -> list[dict]:
    rows = []
    for k in range(2):  # two inputs per micro-batch
        iid = f"it{it}-in{mb * 2 + k}"
        for traj in range(2):
            rows.append({"input_id": iid, "traj": traj, "turn": 0, "mb": mb, "policy_version": it,
                         "parents": [f"{iid}:{traj}:{p}:0" for p in parents],
                         "prompt_ids": list(range(24)), "response_ids": list(range(8)),
                         "logprobs": [-1.0] * 8, "prompt_text": "Q:1+2\nP:", "response_text": "3"})
    return rows


def store_history(out: Path, iterations: int, compact: bool) -> dict[str, Any]:
    from storage import MEGStore, audit_store
    from storage.check import check_store

    root = out / f"store-{'compacted' if compact else 'plain'}"
    shutil.rmtree(root, ignore_errors=True)
    store = MEGStore(str(root))
    team = [("planner", []), ("solver", ["planner"]), ("verifier", ["solver"])]
    files = []
    t0 = time.perf_counter()
    for it in range(iterations):
        store.write_inputs(it, [{"input_id": f"it{it}-in{i}", "text": "1+2", "answer": "3", "split": "train",
                                 "meta": json.dumps({"mb": i // 2, "pos": i % 2})} for i in range(4)])
        for mb in range(2):
            written = {agent: _tiny_rows(it, agent, mb, parents) for agent, parents in team}
            for agent, rows in written.items():
                store.write_samples(agent, it, rows)
            for agent, rows in written.items():
                ids = [f"{r['input_id']}:{r['traj']}:{agent}:0" for r in rows]
                store.write_status(agent, it, [{"sample_id": s, "policy_version": it, "mb": mb, "reward": 1.0}
                                               for s in ids])
                store.mark_consumed(agent, it, [{"sample_id": s, "policy_version": it, "mb": mb} for s in ids],
                                    step=it + 1, advantages=[0.0] * len(ids))
        if compact:
            for agent, _ in team:
                store.compact(agent, it)
        if (it + 1) % max(iterations // 10, 1) == 0:
            files.append({"iteration": it, "files": _bytes(root)[0]})
    write_s = time.perf_counter() - t0
    t = time.perf_counter()
    problems = audit_store(str(root))
    audit_s = time.perf_counter() - t
    t = time.perf_counter()
    check = check_store(str(root))
    check_s = time.perf_counter() - t
    n = _bytes(root)[0]
    return {"iterations": iterations, "compacted": compact, "files": n, "files_per_iteration": n / iterations,
            "write_s": write_s, "audit_s": audit_s, "check_s": check_s, "audit_problems": len(problems),
            "check_problems": len(check), "files_over_time": files}


def op_log_on_s3(ops: int) -> dict[str, Any]:
    from flexmarl_core.driver import metrics
    from flexmarl_core.driver.metrics import MetricsWriter, log_lines
    from flexmarl_core.ops import Op, OpRecord, StageResult
    from flexmarl_core.runfiles.location import RunLocation
    from tests._s3 import start_s3

    server = start_s3("growth")
    try:
        MetricsWriter.MIRROR_EVERY_S = 0.0  # every op: the worst case
        with tempfile.TemporaryDirectory() as tmp:
            w = MetricsWriter(Path(tmp), mirror=RunLocation("s3://growth/run"))
            marks = sorted({m for m in (1000, 5000, 10000, ops) if m <= ops})
            out: dict[str, Any] = {"ops": ops, "part_bytes": metrics.PART_BYTES, "at": []}
            sent: list[int] = []
            t_up: list[float] = []
            for i in range(ops):
                op = Op(i // 35, "rollout", "solver", mb=i % 2)
                res = StageResult(op, samples=4, tokens=32, metrics={f"agent/solver/m{j}": 0.5 for j in range(12)})
                before, t = w.uploaded_bytes["ops.jsonl"], time.perf_counter()
                w.op(OpRecord(op, float(i), float(i) + 0.5, res))
                t_up.append(time.perf_counter() - t)
                sent.append(w.uploaded_bytes["ops.jsonl"] - before)
                if i + 1 in marks:
                    window = slice(max(0, i - 999), i + 1)  # many parts: the sawtooth averaged
                    out["at"].append({"ops": i + 1, "bytes_per_upload": statistics.mean(sent[window]),
                                      "ms_per_op": 1e3 * statistics.mean(t_up[window]),
                                      "whole_file_bytes": (Path(tmp) / "metrics" / "ops.jsonl").stat().st_size})
            w.close()
            assert len(log_lines(RunLocation("s3://growth/run"), "ops.jsonl")) == ops
    finally:
        server.stop()
    first, last = out["at"][0], out["at"][-1]
    out["upload_growth"] = last["bytes_per_upload"] / first["bytes_per_upload"]
    out["whole_file_growth"] = last["whole_file_bytes"] / first["whole_file_bytes"]
    return out


def summarise(long: dict[str, Any]) -> dict[str, Any]:
    rows = long["rows"]
    n = len(rows)
    # The flow's RSS within each attempt (the kill starts a new process): the median of its
    # second tenth against its last tenth, and the growth per op between them.
    attempts: list[dict[str, Any]] = []
    for pid in dict.fromkeys(r["pid"] for r in rows):
        rr = [r for r in rows if r["pid"] == pid]
        t = max(len(rr) // 10, 1)
        warm, end = rr[t:2 * t], rr[-t:]
        w, e = statistics.median(r["flow_rss_mb"] for r in warm), statistics.median(r["flow_rss_mb"] for r in end)
        its = statistics.median(r["iteration"] for r in end) - statistics.median(r["iteration"] for r in warm)
        attempts.append({"iterations": [rr[0]["iteration"], rr[-1]["iteration"]], "rss_mb_after_warmup": w,
                         "rss_mb_end": e, "growth": e / w,
                         "kb_per_op": 1e3 * (e - w) / max(its * long["ops"] / long["iterations"], 1)})
    rss_warm, rss_end = attempts[0]["rss_mb_after_warmup"], attempts[0]["rss_mb_end"]
    half = n // 2
    held_first = max(r["weights_trainers_mb"] for r in rows[:half])
    held_second = max(r["weights_trainers_mb"] for r in rows[half:])
    # what the run holds between steps (a step in flight holds a version more for a moment)
    held_median = [statistics.median(r["weights_trainers_mb"] for r in part) for part in (rows[:half], rows[half:])]
    files_end = rows[-1]["store_files"]
    files_mid = rows[half]["store_files"]
    per_it_files = (files_end - files_mid) / max(rows[-1]["iteration"] - rows[half]["iteration"], 1)
    # CPU per iteration of the flow process, within each attempt (the resumed one restarts at 0)
    cpu = [b["flow_cpu_s"] - a["flow_cpu_s"] for a, b in zip(rows, rows[1:], strict=False) if a["pid"] == b["pid"]]
    q = max(len(cpu) // 4, 1)
    return {
        "flow_rss_mb_after_warmup": rss_warm, "flow_rss_mb_end": rss_end, "flow_rss_growth": rss_end / rss_warm,
        "flow_rss_kb_per_op": statistics.mean(a["kb_per_op"] for a in attempts), "flow_rss_attempts": attempts,
        "weights_trainers_mb_max_first_half": held_first, "weights_trainers_mb_max_second_half": held_second,
        "weights_trainers_mb_median_first_half": held_median[0], "weights_trainers_mb_median_second_half": held_median[1],
        "store_files_end": files_end, "store_files_per_iteration_second_half": per_it_files,
        "flow_cpu_s_per_iteration_first_quarter": statistics.median(cpu[:q]),
        "flow_cpu_s_per_iteration_last_quarter": statistics.median(cpu[-q:]),
        "flow_cpu_ms_per_op_last_quarter": 1e3 * statistics.median(cpu[-q:]) * long["iterations"] / long["ops"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--store-iterations", type=int, default=None)
    ap.add_argument("--ops", type=int, default=None)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-growth"))
    args = ap.parse_args()
    iterations = args.iterations or (60 if args.quick else 300)
    store_its = args.store_iterations or (200 if args.quick else 1000)
    ops = args.ops or (3000 if args.quick else 10000)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from flexmarl.prefect_api import ensure_api

    api, _ = ensure_api()
    load0 = os.getloadavg()[0]
    long = long_run(out, iterations, api)
    summary = summarise(long)
    plain, compacted = store_history(out, store_its, False), store_history(out, store_its, True)
    s3 = op_log_on_s3(ops)
    targets = {
        "disk_bounded": summary["weights_trainers_mb_median_second_half"]
        <= 1.05 * summary["weights_trainers_mb_median_first_half"],
        "flow_rss_flat": summary["flow_rss_growth"] <= 1.10,
        "store_files_per_iteration_bounded": summary["store_files_per_iteration_second_half"] <= 8,
        "op_log_upload_flat": s3["upload_growth"] <= 1.5,
        "prefect_graph_drawable": long["max_task_runs_per_flow_run"] < 10_000,
        "resume_and_audit_clean": long["store_audit_ok"] and long["store_check_ok"],
    }
    result = {"long_run": long, "summary": summary, "store": {"plain": plain, "compacted": compacted},
              "op_log_s3": s3, "targets": targets, "load": [load0, os.getloadavg()[0]]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"long run: {iterations} iterations ({long['ops']} ops), killed after {long['killed_after_iterations']}, "
          f"resumed; {long['wall_s']:.0f} s; audit {long['store_audit_s']:.1f} s, check {long['store_check_s']:.1f} s")
    print(f"  flow RSS {summary['flow_rss_mb_after_warmup']:.0f} -> {summary['flow_rss_mb_end']:.0f} MB "
          f"(x{summary['flow_rss_growth']:.3f}, {summary['flow_rss_kb_per_op']:.1f} KB per op); weights+states held max "
          f"{summary['weights_trainers_mb_max_first_half']:.1f} "
          f"/ {summary['weights_trainers_mb_max_second_half']:.1f} MB (first / second half)")
    print(f"  store files {summary['store_files_end']} ({summary['store_files_per_iteration_second_half']:.1f} per "
          f"iteration, second half); flow CPU {summary['flow_cpu_ms_per_op_last_quarter']:.1f} ms per op")
    for row in (plain, compacted):
        print(f"store {'compacted' if row['compacted'] else 'plain':9s} {row['iterations']} its: {row['files']} files "
              f"({row['files_per_iteration']:.1f}/it), audit {row['audit_s']:.1f} s, check {row['check_s']:.1f} s")
    for a in s3["at"]:
        print(f"op log at {a['ops']:6d} ops: {a['bytes_per_upload']:8.0f} B per upload ({a['ms_per_op']:.1f} ms), "
              f"whole file {a['whole_file_bytes']:9d} B")
    print("targets:", json.dumps(targets))
    return 0  # the targets are figures (in the JSON), not the bench's success


if __name__ == "__main__":
    sys.exit(main())
