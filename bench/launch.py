"""A launch's fixed cost: `flexmarl train` of the tiny team for 3 iterations, timed from the
command's start to its exit, and cut where the run's op log says: until its first op starts
(imports, checks, the cluster's start and the workers' imports), its ops, and from its last op
to the exit (the cluster's stop, pictures, report, the interpreter's exit).

    python bench/launch.py --json bench/results/launch.json --baseline /tmp/flexmarl-bench/<sha12>
    python bench/launch.py --json /tmp/launch.json --quick

`--baseline DIR` names a checkout of another commit (`bench/results/record.sh` exports one):
the two are launched in turn, `--rounds` times each, on one Prefect API this script starts,
and the ratio is taken pair by pair, so the machine's drift moves both sides alike.

JSON keys: `rounds`, `sides` (per side: `tree`, `wall_s` (each launch), `median_wall_s`,
`median_to_first_op_s`, `median_ops_s`, `median_after_last_op_s`), `ratio_wall` (the median of
the pairwise wall ratios, this tree over the baseline; absent without one), `load` (the
1-minute load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETS = ["cluster.prefect_lean=true", "workload.reward=tests.reward_fns:varied", "workload.credit=team",
        "train.iterations=3", "train.evaluate=false"]


def launch(tree: Path, api: str, run_dir: Path) -> dict[str, float]:
    """One launch from `tree`: its wall seconds, and where they went by the run's op log."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PREFECT_API_URL": api}
    sets = [x for s in [f"run_dir={run_dir}", *SETS] for x in ("--set", s)]
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "flexmarl.cli", "train", "configs/tiny.yaml", *sets, "--no-progress"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    t1 = time.time()
    if res.returncode != 0:
        raise SystemExit(f"launch from {tree} failed ({res.returncode}): {res.stdout[-2000:]}{res.stderr[-2000:]}")
    ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    first, last = min(o["t_start"] for o in ops), max(o["t_end"] for o in ops)
    return {"wall_s": t1 - t0, "to_first_op_s": first - t0, "ops_s": last - first, "after_last_op_s": t1 - last}


def side(tree: Path, runs: list[dict[str, float]]) -> dict[str, object]:
    med = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    return {"tree": str(tree), "wall_s": [round(r["wall_s"], 2) for r in runs], "median_wall_s": med["wall_s"],
            "median_to_first_op_s": med["to_first_op_s"], "median_ops_s": med["ops_s"],
            "median_after_last_op_s": med["after_last_op_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, launched in turn with this one")
    args = ap.parse_args()
    rounds = 2 if args.quick else args.rounds
    trees = {"this": Path.cwd()} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    from prefect.testing.utilities import prefect_test_harness

    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    with prefect_test_harness(server_startup_timeout=120), tempfile.TemporaryDirectory() as tmp:
        from prefect.settings import PREFECT_API_URL

        api = PREFECT_API_URL.value()
        launch(trees["this"], api, Path(tmp) / "warm")  # builds the tiny team's tokenizer cache once
        for i in range(rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[name].append(launch(trees[name], api, Path(tmp) / f"{name}-{i}"))
                print(f"round {i + 1}/{rounds} {name}: {runs[name][-1]['wall_s']:.2f} s", flush=True)
    out: dict[str, object] = {"rounds": rounds, "sides": {k: side(trees[k], v) for k, v in runs.items()},
                              "load": {"before": load_before, "after": os.getloadavg()[0]}}
    if args.baseline:
        out["ratio_wall"] = round(statistics.median(a["wall_s"] / b["wall_s"]
                                                    for a, b in zip(runs["this"], runs["baseline"], strict=True)), 3)
    print(f"{'side':<10} {'wall s':>8} {'to 1st op':>10} {'ops':>6} {'after':>6}")
    for k, s in out["sides"].items():
        print(f"{k:<10} {s['median_wall_s']:>8.2f} {s['median_to_first_op_s']:>10.2f} {s['median_ops_s']:>6.2f} "
              f"{s['median_after_last_op_s']:>6.2f}")
    if "ratio_wall" in out:
        print(f"this / baseline, wall (median of {rounds} pairs): {out['ratio_wall']}")
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
