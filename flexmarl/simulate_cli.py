"""`flexmarl simulate`: the real orchestrator on a virtual clock (every figure it prints or
writes is simulated, and says so)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flexmarl_core.config.checks import ConfigError


def cmd_simulate(args: argparse.Namespace) -> int:
    """Every figure printed or written here is simulated, and says so."""

    if args.calibrate:
        if args.config or args.cluster or args.sweep:
            raise ConfigError("--calibrate RUN replays the run's own config on its own workers: "
                              "give no CONFIG, --cluster or --sweep with it")
        return _simulate_calibrate(args)
    if args.config is None or args.cluster is None:
        raise ConfigError("simulate: give CONFIG and --cluster CLUSTER.yaml, or --calibrate RUN")
    if args.sweep:
        return _simulate_sweep(args)
    return _simulate_tables(args)


def _write_json(path: str | None, data: dict) -> None:

    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str))
        print(f"wrote {path} (simulated)")


def _simulate_tables(args: argparse.Namespace) -> int:
    """Table 2 (sync vs co-design) and Table 3 (each switch off) of CONFIG on the cluster."""
    from flexmarl_core.sim import report, study

    results, cluster = study.run_modes(args.config, args.cluster, args.set)
    tables = study.tables(results)
    cod, sync = results[study.CODESIGN], results[study.SYNC]
    print(report.mode_table(f"Table 2: {args.config} on {cluster.name}",
                            {study.SYNC: sync.summary, study.CODESIGN: cod.summary}, baseline=study.SYNC))
    t3 = {study.CODESIGN: cod.summary, **{m: results[m].summary for m in tables.get("table3", {})}}
    print(report.mode_table("Table 3: each switch off alone", t3, baseline=study.CODESIGN))
    s = cod.summary
    print(f"simulator: {s['sim_cpu_s_per_iteration']:.3f} CPU-s per simulated iteration, {s['workers']} "
          f"device groups, {s['balance_moves']} instance moves, {s['train_swaps']} trainer swaps "
          "(co-design, simulated)")
    _write_json(args.json, {**tables, "config": args.config, "cluster": cluster.model_dump(),
                            "sources": cluster.sources, "runs": {m: r.summary for m, r in results.items()},
                            "iterations": {m: r.iterations for m, r in results.items()}})
    if args.timeline:
        p = Path(args.timeline)
        for res, path, mode in ((cod, p, study.CODESIGN), (sync, p.with_name(f"{p.stem}-sync{p.suffix}"), study.SYNC)):
            report.timeline_png(res.records, res.decisions, path, f"{args.config}: {mode}")
            print(f"wrote {path} (simulated timeline)")
    return 0


def _simulate_calibrate(args: argparse.Namespace) -> int:
    """Fit RUN's cost model from its op log and replay its config (with --set: a what-if)."""
    from flexmarl_core.driver.plots import load_trace, timeline
    from flexmarl_core.sim import report, study

    out, sim = study.replay(args.calibrate, args.set)
    s = out["simulated"]
    title = f"replay of {args.calibrate} with its fitted cost model"
    if "measured" in out:
        m = out["measured"]
        print(f"{title}\n{'':12s} {'E2E s/it':>10s} {'tokens/s':>10s}")
        print(f"{'measured':12s} {m['e2e_s_per_iteration']:10.2f} {m['tokens_per_s']:10.0f}")
        print(f"{'simulated':12s} {s['e2e_s_per_iteration']:10.2f} {s['tokens_per_s']:10.0f}")
        print(f"E2E error of the simulated replay: {100 * out['e2e_error']:+.1f}%")
    else:
        print(report.mode_table(f"{title}, overrides {args.set}", {"simulated": s}))
    _write_json(args.json, out)
    if args.timeline:
        p = Path(args.timeline)
        # The measured run above its replay, on one time axis, as `flexmarl report --compare`.
        timeline([load_trace(args.calibrate, "measured"), report.trace(sim.records, sim.decisions, "simulated")],
                 p, title=f"{args.calibrate}: measured run and its simulated replay")
        print(f"wrote {p} (measured and simulated timelines)")
    return 0


def _simulate_sweep(args: argparse.Namespace) -> int:
    from flexmarl.prefect_api import ensure_api
    from flexmarl_core.config import load_config
    from flexmarl_core.sim.cluster import load_cluster
    from flexmarl_core.sim.study import SYNC, split_overrides
    from flows.simulate import points, sweep

    # A malformed sweep, config, cluster file or override fails before a server or cluster starts.
    for extra, _mode in points(args.sweep):
        cfg_over, sim_over = split_overrides([*args.set, *extra])
        load_config(args.config, cfg_over)
        load_cluster(args.cluster, sim_over)
    api, _ = ensure_api()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}):
        out = sweep(args.config, args.cluster, args.sweep, args.set)
    print(f"sweep {args.sweep} (simulated)")
    print(f"{'point':36s} {'mode':24s} {'E2E s/it':>10s} {'tokens/s':>10s}")
    e2e = {(tuple(r["overrides"]), r["mode"]): r["e2e_s_steady"] for r in out["points"]}
    for r in out["points"]:
        key = tuple(r["overrides"])
        ratio = e2e[(key, SYNC)] / r["e2e_s_steady"] if (key, SYNC) in e2e else None
        print(f"{' '.join(r['overrides']) or '-':36s} {r['mode']:24s} {r['e2e_s_steady']:10.1f} "
              f"{r['tokens_per_s_steady']:10.0f}" + (f"   {ratio:.2f}x vs sync" if ratio else ""))
    print("E2E and tokens/s: steady state, the iterations after the first (simulated)")
    _write_json(args.json, out)
    return 0
