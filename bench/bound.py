"""What a schedule of one run's measured ops could do at best, from that run's own op log: the
floors, a list schedule and replays under other policies (`flexmarl_core.analysis.bound`).

    python bench/bound.py RUN_DIR [RUN_DIR ...] [--workers 2] [--longest-first AGENT]
    python bench/bound.py RUN_DIR ... --no-replays --json OUT

`--json` writes each run folder's figures (`e2e_s`, `floor_s`, `work_floor_s`, `chain_floor_s`,
`list_s`, `best_list_s`, `best_list_serial_s` (the search with an agent's train ops one at a
time), `floor_frac`, `best_frac`: the best schedule found over E2E; without `--no-replays`,
`cpu_replay_late_binding.{false,true}` and `replay.<policy>.e2e_s`) under its
path, and `by_sync` for a `sync-N` folder beside a `codesign-N` one: the floor and the best
schedule of the sync run's ops on the co-design's graph, and `speedup_bound` /
`speedup_reachable` (the sync E2E over each).
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--no-replays", action="store_true", help="the floors and schedules only")
    ap.add_argument("--json", metavar="OUT", help="write each run folder's figures here")
    args = ap.parse_args()
    figures: dict[str, dict] = {}
    for rd in args.run_dirs:
        a = bound.analyse(rd, args.workers)
        figures[str(rd)] = fig = {k: v for k, v in a.items() if k != "idle_causes"}
        fig["best_frac"] = a["best_list_s"] / a["e2e_s"]
        sync = rd.with_name(rd.name.replace("codesign-", "sync-"))
        if rd.name.startswith("codesign-") and sync.is_dir():
            s = bound.analyse(rd, args.workers, durations_from=sync)
            e2e = bound.analyse(sync, args.workers, search=False)["e2e_s"]
            fig["by_sync"] = {"e2e_s": e2e, "floor_s": s["floor_s"], "best_list_s": s["best_list_s"],
                              "speedup_bound": e2e / s["floor_s"], "speedup_reachable": e2e / s["best_list_s"]}
        for lb in () if args.no_replays else ("false", "true"):
            c = bound.cpu_replay(rd, args.workers, (f"codesign.late_binding={lb}",))
            fig.setdefault("cpu_replay_late_binding", {})[lb] = {
                k: v for k, v in c.items() if k != "idle_causes_codesign"}
            print(f"  on CPU seconds, late binding {lb:5s}: co-design {c['e2e_s_codesign']:.1f} s (util "
                  f"{c['util_codesign']:.2f}), sync {c['e2e_s_sync']:.1f} s (util {c['util_sync']:.2f}), speedup "
                  f"{c['speedup']:.2f}x of a bound {c['speedup_bound']:.2f}x; co-design at "
                  f"{c['floor_frac_codesign']:.2f} of its floor")
        for name, ov in () if args.no_replays else (
                ("its config", []), ("late binding", ["codesign.late_binding=true"]),
                ("early binding", ["codesign.late_binding=false"])):
            r = bound.replay(rd, ov)
            fig.setdefault("replay", {})[name] = {"e2e_s": r["e2e_s"], "utilization": r["utilization"]}
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
        if "by_sync" in fig:
            b = fig["by_sync"]
            print(f"  the sync run's ops on this graph: floor {b['floor_s']:.1f} s, best schedule found "
                  f"{b['best_list_s']:.1f} s; sync E2E {b['e2e_s']:.1f} s: bound {b['speedup_bound']:.2f}x, "
                  f"reachable {b['speedup_reachable']:.2f}x")
        for w, c in a["idle_causes"].items():
            print(f"  {w} idle: " + ", ".join(f"{k} {v:.1f}s" for k, v in list(c.items())[:5]))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
