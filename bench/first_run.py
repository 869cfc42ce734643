"""The first run as a new user meets it: `make run` on a fresh clone, each phase timed, with the
machine's load.

    python bench/first_run.py --json bench/results/first-run.json            # the README's figure
    python bench/first_run.py --json /tmp/first-run.json --quick             # 2 RL iterations

A clone of COMMIT (default HEAD) is made in a temporary folder, `make setup` runs there (pip's
own cache is whatever this machine has: `setup_s` says how long it took here, not on a machine
that downloads every wheel), then `make run`, whose output is read line by line as it comes and
stamped. The phases are cut at the lines the run prints:

- `startup`: from `make run`'s start to the warm-start line (the local Prefect server, the
  Dask cluster, the config checks);
- `sft`: the warm start (`warm start: SFT ...` to `warm start: SFT made ...`);
- `rl`: from there to the last `iteration N/N` line;
- `evaluation`: from there to the `held-out team accuracy` line (the held-out evaluation of
  the trained team), and `finish` the rest (pictures, report, exit).

The load average is sampled every 5 s throughout. The JSON holds the phases, the load, the
summary lines exactly as printed (the quickstart pastes them from here), and the held-out
figures; `first-run.log` beside it is the whole terminal output, `first-run.stamps.json` each line
with its second (the phases can be cut again from it), and `iteration_rows` the run's
`metrics/iterations.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from _fresh import LoadSampler, fresh_clone, machine  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = re.compile(r"held-out team accuracy: ([\d.]+) before RL -> ([\d.]+) after \(([+-][\d.]+)\)")
ITERATION = re.compile(r"^iteration (\d+)/(\d+) ")


def stamped_run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[int, list[tuple[float, str]]]:
    """Run `cmd`, teeing its merged output to `log`; each line with seconds since the start."""
    t0 = time.monotonic()
    lines: list[tuple[float, str]] = []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))
            out.write(line)
            out.flush()
        rc = proc.wait()
    lines.append((time.monotonic() - t0, ""))  # the process's end
    return rc, lines


def phases(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Cut the stamped output at the lines the run prints (see the module docstring)."""

    def first(pred, default=None):
        return next((t for t, s in lines if pred(s.strip())), default)

    end = lines[-1][0]
    sft_start = first(lambda s: s.startswith("warm start: SFT of"))
    sft_end = first(lambda s: s.startswith(("warm start: SFT made", "warm start: SFT reused")))
    iters = [(t, s) for t, s in lines if ITERATION.match(s.strip())]
    held = first(lambda s: bool(HELD_OUT.search(s)))
    if sft_end is None or not iters or held is None:
        raise SystemExit("first_run: the run's output lacks the warm-start, iteration or held-out "
                         "lines; see the log")
    start_rl = sft_end
    out = {"startup": sft_start if sft_start is not None else sft_end,
           "sft": sft_end - (sft_start if sft_start is not None else sft_end),
           "rl": iters[-1][0] - start_rl, "evaluation": held - iters[-1][0], "finish": end - held}
    return {k: round(v, 1) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, metavar="OUT", help="write the record here")
    ap.add_argument("--quick", action="store_true", help="2 RL iterations instead of the config's")
    ap.add_argument("--commit", default="HEAD", help="what to clone (default HEAD)")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = ap.parse_args()

    sha, work, clone = fresh_clone(REPO, args.commit, "flexmarl-first-run-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FLEXMARL_", "VIRTUAL_ENV"))}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    load = LoadSampler()
    load.start()
    started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    load_before = Path("/proc/loadavg").read_text().split()[:3]

    t0 = time.monotonic()
    subprocess.run(["make", "setup"], cwd=clone, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    setup_s = time.monotonic() - t0
    cmd = ["make", "run"]
    if args.quick:
        # `make run` is `flexmarl train $(CONFIG)`; the quick record trains 2 iterations of it.
        cmd = [".venv/bin/flexmarl", "train", "configs/default.yaml", "--set", "train.iterations=2"]
    env_run = {**env, "PYTHONUNBUFFERED": "1"}
    rc, lines = stamped_run(cmd, clone, env_run, log)
    loads = load.stop()
    # the stamped lines, kept whatever follows: the phases can be cut again from them
    log.with_suffix(".stamps.json").write_text(json.dumps(lines))
    if rc != 0:
        raise SystemExit(f"first_run: `{' '.join(cmd)}` exited {rc}; see {log}")
    text = [s.strip() for _, s in lines]
    rows_file = clone / "runs" / "arith-team" / "metrics" / "iterations.jsonl"
    rows = [json.loads(x) for x in rows_file.read_text().splitlines() if x.strip()] if rows_file.exists() else []
    held = next(HELD_OUT.search(s) for s in text if HELD_OUT.search(s))
    iters = [s for s in text if ITERATION.match(s)]
    i_held = next(i for i, s in enumerate(text) if HELD_OUT.search(s))
    record = {
        "command": "make run" if not args.quick else " ".join(cmd),
        "commit": sha, "start_utc": started,
        "quick": args.quick,
        "setup_s": round(setup_s, 1),
        "make_run_s": round(lines[-1][0], 1),
        "phases_s": phases(lines),
        "load_before": load_before, "load": loads,
        "held_out_before": float(held.group(1)), "held_out_after": float(held.group(2)),
        "held_out_gain": float(held.group(3)),
        "iterations": len(iters),
        # what the terminal showed at the end, pasted by the quickstart
        "last_iteration_line": iters[-1],
        "summary_lines": text[i_held - 1:i_held + 2],
        "machine": machine(),
        # the run's metrics/iterations.jsonl, for the per-iteration figures the guides quote
        "iteration_rows": rows,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    if args.keep:
        print(f"clone kept at {clone}")
    else:
        # The run's local Prefect server outlives `make run` on purpose (the UI link): stop it.
        subprocess.run([str(clone / ".venv/bin/flexmarl"), "server", "stop"], cwd=clone,
                       env={**env, "PREFECT_HOME": str(clone / ".prefect")},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    ph = record["phases_s"]
    print(f"setup {record['setup_s']:.0f} s; make run {record['make_run_s']:.0f} s = startup {ph['startup']:.0f} "
          f"+ SFT {ph['sft']:.0f} + RL {ph['rl']:.0f} + evaluation {ph['evaluation']:.0f} + finish {ph['finish']:.0f}; "
          f"load mean {loads['mean']} max {loads['max']}; held-out {record['held_out_before']} -> "
          f"{record['held_out_after']}")


if __name__ == "__main__":
    main()
