"""This machine's parallel efficiency: how fast each of two busy processes runs the workers'
kind of work relative to one alone (`flexmarl_core.analysis.shortfall`, which `bench/e2e.py`
uses to say why a wall-time speedup falls short of its bound).

    python bench/shortfall.py --json runs/bench/parallel_efficiency.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flexmarl_core.analysis import shortfall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 4 steps")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--preset", default="tiny-10m")
    args = ap.parse_args()
    res = shortfall.parallel_efficiency(args.preset, steps=4 if args.quick else 8,
                              rounds=args.rounds or (2 if args.quick else 5))
    print("parallel efficiency (each of two busy processes vs one alone): "
          + ", ".join(f"{e:.3f}" for e in res["per_round"]) + f"; median {res['median']:.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
