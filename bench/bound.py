"""What a schedule of one run's measured ops could do at best, from that run's own op log: the
floors, a list schedule and replays under other policies (`flexmarl_core.analysis.bound`).

    python bench/bound.py RUN_DIR [RUN_DIR ...] [--workers 2] [--longest-first AGENT]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flexmarl_core.analysis import bound


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--longest-first", metavar="AGENT",
                    help="also replay (CPU seconds) with each iteration's micro-batches started "
                    "longest first by AGENT's measured rollout seconds")
    args = ap.parse_args()
    for rd in args.run_dirs:
        a = bound.analyse(rd, args.workers)
        for lb in ("false", "true"):
            c = bound.cpu_replay(rd, args.workers, (f"codesign.late_binding={lb}",))
            print(f"  on CPU seconds, late binding {lb:5s}: co-design {c['e2e_s_codesign']:.1f} s (util "
                  f"{c['util_codesign']:.2f}), sync {c['e2e_s_sync']:.1f} s (util {c['util_sync']:.2f}), speedup "
                  f"{c['speedup']:.2f}x of a bound {c['speedup_bound']:.2f}x; co-design at "
                  f"{c['floor_frac_codesign']:.2f} of its floor")
        for name, ov in (("its config", []), ("late binding", ["codesign.late_binding=true"]),
                         ("early binding", ["codesign.late_binding=false"])):
            r = bound.replay(rd, ov)
            print(f"  replay {name:14s}: E2E {r['e2e_s']:.1f} s, util {r['utilization']:.2f}; idle "
                  + "; ".join(f"{w}: " + ", ".join(f"{k} {v:.0f}s" for k, v in list(c.items())[:3])
                              for w, c in r["idle_causes"].items()))
        if args.longest_first:
            for name, dd in (("as run", None), ("longest first", args.longest_first)):
                r = bound.replay(rd, [], clock="cpu", longest_first_by=dd)
                print(f"  replay on CPU seconds, micro-batches {name:13s}: E2E {r['e2e_s']:.1f} s, "
                      f"util {r['utilization']:.3f}")
        print(f"{rd}: E2E {a['e2e_s']:.1f} s; floor {a['floor_s']:.1f} s (work {a['work_floor_s']:.1f}, "
              f"chain {a['chain_floor_s']:.1f}), list schedule {a['list_s']:.1f} s, best of a search "
              f"{a['best_list_s']:.1f} s; floor / E2E {a['floor_frac']:.2f}")
        for w, c in a["idle_causes"].items():
            print(f"  {w} idle: " + ", ".join(f"{k} {v:.1f}s" for k, v in list(c.items())[:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
