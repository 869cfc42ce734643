"""What the ReAct calculator agent's sampled tool calls got right, iteration by iteration.

Reads the solver samples that `configs/program_react.yaml` runs stored (`bench/learning.py
--config configs/program_react.yaml --out DIR` leaves one run folder per seed) and counts, per
iteration, the samples that call the calculator, that copy the problem's operator, that copy
both operands, and whose call is the problem exactly. It tells which part of the tool loop RL
moves: the sampled calls at the sampling temperature, not the greedy held-out answers.

    python bench/react_calls.py --runs DIR/async-0 DIR/async-1 --json OUT
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds

from flexmarl_core.workloads.calculator import WORDS

# either phrasing of the calculator workload (`params.phrasing`): `57*23` or `57 times 23`
_PROBLEM = re.compile(rf"Compute (\d+) ?([+*-]|{'|'.join(WORDS.values())}) ?(\d+)<")
_SYMBOL = {word: op for op, word in WORDS.items()}
_CALL = re.compile(r'"expression": "(\d+)([+*-])(\d+)"')
FIELDS = ("reward", "call", "op_ok", "args_ok", "call_ok")


def per_iteration(run_dir: Path) -> list[dict]:
    """Each iteration's shares of the solver's samples (FIELDS), with its sample count; the
    reward is the mean over the samples that hold one (None where none does)."""
    parts = run_dir / "store" / "samples" / "agent=solver"
    if not parts.is_dir():
        raise SystemExit(f"{run_dir}: no solver samples under store/samples (a react run folder?)")
    table = ds.dataset(parts, format="parquet", partitioning="hive").to_table(
        columns=["iteration", "prompt_text", "response_text", "reward"])
    counts: dict[int, Counter] = {}
    for row in table.to_pylist():
        c = counts.setdefault(row["iteration"], Counter())
        c["n"] += 1
        if row["reward"] is not None:  # stores of earlier versions kept no reward on the sample
            c["scored"] += 1
            c["reward"] += row["reward"]
        q = _PROBLEM.search(row["prompt_text"])
        if q is None:
            raise SystemExit(f"{run_dir}: a prompt without `Compute a?b`: not the calculator program")
        want = (q[1], _SYMBOL.get(q[2], q[2]), q[3])
        m = _CALL.search(row["response_text"])
        if m:
            c["call"] += 1
            c["op_ok"] += m[2] == want[1]
            c["args_ok"] += (m[1], m[3]) == (want[0], want[2])
            c["call_ok"] += m.groups() == want
    return [{"iteration": it, "samples": c["n"], **{k: c[k] / c["n"] for k in FIELDS[1:]},
             "reward": c["reward"] / c["scored"] if c["scored"] else None}
            for it, c in sorted(counts.items())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="RUN_DIR")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    runs = {str(Path(r)): per_iteration(Path(r)) for r in args.runs}
    print(f"{'run':>28s} {'it':>3s} {'samples':>7s} " + " ".join(f"{f:>8s}" for f in FIELDS))
    for name, rows in runs.items():
        for r in rows:
            print(f"{name[-28:]:>28s} {r['iteration']:3d} {r['samples']:7d} "
                  + " ".join(f"{r[f]:8.3f}" if r[f] is not None else f"{'-':>8s}" for f in FIELDS))

    def first_last(field: str, last: bool) -> float | None:
        got = [rows[-1 if last else 0][field] for rows in runs.values()]
        return None if None in got else sum(got) / len(got)

    summary = {f"{f}_{end}": first_last(f, end == "last") for f in FIELDS for end in ("first", "last")}
    print("mean over runs, first -> last iteration: "
          + ", ".join(f"{f} {summary[f + '_first']:.3f} -> {summary[f + '_last']:.3f}" for f in FIELDS
                      if summary[f + "_first"] is not None))
    Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
