"""End-to-end: the co-design (all switches on) against the synchronous multi-agent baseline
(all off) on the same work and seed, through the real stack (Prefect flow, Dask workers, MEG
Store), alternating the two so machine noise hits both alike.

    python bench/e2e.py --json runs/bench/e2e.json [--quick] [--config configs/default.yaml]
    python bench/e2e.py --json runs/bench/e2e-longtail.json --workload longtail

Reports E2E seconds per iteration, tokens/s and utilisation (busy / wall over all workers)
for each mode, their ratios, the share of CPU spent on Prefect + Dask bookkeeping, and the
co-design's work mix (`train_share`) and what the best schedule could do, each from one run's
own op log (`flexmarl_core.analysis.bound`): `speedup_bound` (sync E2E over the floor of the sync run's ops on
the co-design's graph), `speedup_reachable` (sync E2E over the best schedule a search found of
those ops: the part of the bound a scheduler that knew every duration could reach),
`floor_frac_codesign` (the co-design run's floor over its E2E), `best_list_s_codesign`, and
each worker's idle time by what the other one ran meanwhile (`idle_causes`).
`--workload NAME` benches a built-in team with the work pinned for it (`WORKLOADS`); every
run also reports the sampled length distribution per agent (`lengths`: p50, p90, max), peak
resident memory per worker (`peak_rss_gib`), and the work that never reaches a gradient:
decode steps of rows finished early (`wasted_decode_frac`) and skipped zero-advantage samples
(`skipped_train_frac`), with `same_work` checking both modes did exactly the same work.
With --ablation it also runs each switch off alone (keys `ablation.<switch>`; --also-off SWITCH
adds one for any `codesign.SWITCH`, e.g. `gradient_helpers`); with --reference,
the synchronous schedule on a shared worker pool (key `reference.sync_shared_pool`); with
--staleness K..., the co-design with `codesign.max_staleness=K` and every agent on the
`decoupled_ppo` loss (keys `staleness.k<K>`: E2E s/it, utilisation, speedup over k = 0, the
`codesign` mode, and `train_share`); `--late` adds each K with late binding too
(`staleness.late_k<K>`).
`shortfall` (`flexmarl_core.analysis.shortfall`) says why the wall speedup is under the bound (speedup ~
bound x ops ratio x floor fraction): a gradient helper's CPU per token over the
trainer's own, and this machine's parallel efficiency (each of two busy processes' speed over one
alone, measured before the first run and after the last) with the ceiling it puts on a schedule
that keeps both cores busy (`speedup_ceiling_machine`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from flexmarl_core.analysis import bound, shortfall
from flexmarl_core.config import SWITCHES, switch_overrides

REPO = Path(__file__).resolve().parents[1]

SHARED_POOL = ("cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}, "
               "{name: w1, resources: {rollout: 1, train: 1}}]")


def staleness_modes(config: str, ks: list[int], late: bool = False) -> dict[str, list[str]]:
    """Co-design with bounded staleness k (k > 0 needs an off-policy loss on every agent, and
    no gradient helpers: the config refuses them with staleness); `late`: also with late
    binding (`staleness.late_k<K>`)."""
    from flexmarl_core.config import load_config

    agents = [a.name for a in load_config(config).team.agents]
    on = switch_overrides(on=SWITCHES)
    out = {f"staleness.k{k}": [*on, f"codesign.max_staleness={k}", "codesign.gradient_helpers=false",
                               *[f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in agents]]
           for k in ks if k > 0}
    if late:
        out.update({m.replace(".k", ".late_k"): [*sw, "codesign.late_binding=true"] for m, sw in out.items()})
    return out


def modes(ablation: bool, reference: bool = False) -> dict[str, list[str]]:
    out = {
        "codesign": switch_overrides(on=SWITCHES),
        "sync": switch_overrides(off=SWITCHES),  # and what acts through them (late binding, helpers)
    }
    if reference:
        # Not the baseline: the synchronous schedule on workers that serve every agent (no
        # static instances). Shows how much of the speedup is placement vs scheduling.
        out["reference.sync_shared_pool"] = [*out["sync"], SHARED_POOL]
    if ablation:
        for off in SWITCHES:
            out[f"ablation.{off}"] = switch_overrides(on=[s for s in SWITCHES if s != off], off=[off])
    return out


def server_cpu_s(home: Path | None = None) -> float | None:
    """CPU seconds used so far by the local Prefect server flexmarl started (its pid file in
    `home`, default PREFECT_HOME), children included; None when the API is not ours to measure."""
    import os

    import psutil

    home = home or Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    pidfile = home / "flexmarl-server.pid"
    if not pidfile.exists():
        return None
    try:
        text = pidfile.read_text().strip()  # a JSON record ({"pid": ...}) or, from older runs, the pid
        pid = int(json.loads(text)["pid"]) if text.startswith("{") else int(text.split()[0])
        proc = psutil.Process(pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
        return total
    except (psutil.Error, ValueError):
        return None


#: the work this bench measures: the default team from random weights, 64 problems per
#: iteration in four micro-batches like the default config's (two until the floor round of
#: issue 18 measured 4 best; the config's warm start and larger RL batch are for learning, and
#: would change what is timed)
BENCH_WORK = ["train.warm_start=none", "train.evaluate_initial=false",
              "batch.inputs_per_iteration=64", "batch.micro_batch_inputs=16"]


#: built-in teams `--workload` benches: (config, the work pinned for it). The long-tail team
#: starts from a short SFT (60 steps, cached after the first run): from random weights the
#: solver never writes working, so every row would run to max_new_tokens and there would be no
#: long tail; 60 steps teach the format and lengths that follow the problem, which is what is
#: timed (accuracy is `bench/learning.py`'s business).
WORKLOADS = {
    "default": ("default.yaml", BENCH_WORK),
    "longtail": ("longtail_team.yaml", ["train.evaluate=false", "train.evaluate_initial=false",
                                        "train.sft_max_steps=60", "train.sft_eval_every=60"]),
}


def _quantile(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))]) if xs else 0.0


def lengths(run_dir: Path) -> dict[str, dict[str, float]]:
    """Sampled response lengths (tokens) per agent over the whole run, from its MEG Store."""
    from flexmarl_core.config import load_config
    from storage import MEGStore

    cfg = load_config(run_dir / "config.yaml")
    store = MEGStore(cfg.resolved_store_uri())
    out = {}
    for a in cfg.team.agents:
        ls = [len(r) for it in range(cfg.train.iterations)
              for r in store.read_samples(a.name, it, columns=["response_ids"]).column("response_ids").to_pylist()]
        out[a.name] = {"p50": _quantile(ls, 0.5), "p90": _quantile(ls, 0.9), "max": float(max(ls, default=0)),
                       "mean": sum(ls) / max(len(ls), 1), "n": float(len(ls))}
    return out


def op_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines()]


def peak_rss_gib(run_dir: Path) -> dict[str, float]:
    """Each worker's peak resident memory during the run (its ops' `peak_rss`), GiB."""
    out: dict[str, float] = {}
    for r in op_rows(run_dir):
        out[r["worker"]] = max(out.get(r["worker"], 0.0), r.get("peak_rss", 0) / 1024**3)
    return dict(sorted(out.items()))


def idle_per_worker(run_dir: Path) -> dict[str, float]:
    """Each worker's idle share of the run's iteration windows (1 - busy / E2E)."""
    its = [json.loads(line) for line in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    span = sum(m["e2e_s"] for m in its)
    workers = sorted({k.split("/", 1)[1] for m in its for k in m if k.startswith("busy_s/")})
    return {w: 1.0 - sum(m.get(f"busy_s/{w}", 0.0) for m in its) / span for w in workers}


def idle_work(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per agent, work that never reaches a gradient: decode slots of rows that had finished
    (of all decode slots) and tokens of skipped zero-advantage samples (of all train tokens)."""
    sums: dict[str, float] = {}
    for r in op_rows(run_dir):
        for k, v in r.items():
            if k.startswith("agent/") and k.endswith(("decode_slots", "skipped_tokens", "skipped_samples")):
                sums[k] = sums.get(k, 0.0) + float(v)
    agents = sorted({k.split("/")[1] for k in sums})
    out = {}
    for a in agents:
        slots = sums.get(f"agent/{a}/rollout/decode_slots", 0.0)
        wasted = sums.get(f"agent/{a}/rollout/wasted_decode_slots", 0.0)
        out[a] = {"decode_slots": slots, "wasted_decode_slots": wasted,
                  "wasted_decode_frac": wasted / slots if slots else 0.0,
                  "skipped_samples": sums.get(f"agent/{a}/train/skipped_samples", 0.0),
                  "skipped_tokens": sums.get(f"agent/{a}/train/skipped_tokens", 0.0)}
    return out


def plain_dask_run(config: str, overrides: list[str]) -> dict:
    """The same ops through `DaskExecutor`, no Prefect; returns CPU and wall figures."""
    from flexmarl_core import cluster
    from flexmarl_core.config import load_config
    from flexmarl_core.driver import run

    cfg = load_config(config, overrides)
    run_dir = run.prepare_run(cfg)
    with cluster.cluster_for(cfg.cluster) as client:
        out = run.train(cfg, run_dir, cluster.DaskExecutor(client, str(run_dir)))
    workers_cpu = out.worker_cpu_s or 0.0
    s = out.summary()
    s.update(total_cpu_s=workers_cpu + out.flow_cpu_s, workers_cpu_s=workers_cpu)
    print(f"{'codesign on plain Dask':32s}      : {s['e2e_s_per_iteration']:.2f} s/it, "
          f"total CPU {s['total_cpu_s']:.1f} s", flush=True)
    return s


def work_mix(run_dir: Path, iterations: int, workers: int = 2) -> dict:
    """Stage seconds by kind from a run's op log, and what they allow: `ideal_s_per_it` is the
    E2E per iteration of a perfect packing of that measured work on `workers` one-thread
    workers (no idle time, no dependency waits): a floor for this work as measured (a
    different schedule changes stage times only through contention and swaps)."""
    by_kind: dict[str, float] = {}
    for line in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0.0) + r["t_end"] - r["t_start"]
    total = sum(by_kind.values())
    return {"stage_s": by_kind, "train_share": (by_kind.get("train", 0.0) + by_kind.get("step", 0.0)) / total,
            "rollout_share": by_kind.get("rollout", 0.0) / total,
            "ideal_s_per_it": total / workers / iterations}


def bounds(out_dir: Path, repeats: int, iterations: int, workers: int = 2) -> dict:
    """Each run's floor from its own op log (`flexmarl_core.analysis.bound`), medians over the repeats:
    `speedup_bound` (sync E2E / the floor of the sync run's ops on the co-design's graph),
    `floor_frac_codesign` (the co-design run's floor / its E2E: how close its schedule came to
    the best one of its own ops), `list_s_codesign` (a greedy schedule of them), the sync /
    co-design stage-time ratio that links the two, and where each worker's idle time went."""
    cd = [bound.analyse(out_dir / f"codesign-{rep}", workers) for rep in range(repeats)]
    sy = [bound.analyse(out_dir / f"codesign-{rep}", workers, durations_from=out_dir / f"sync-{rep}")
          for rep in range(repeats)]
    sync_e2e = [bound.analyse(out_dir / f"sync-{rep}", workers, search=False)["e2e_s"] for rep in range(repeats)]
    med = statistics.median
    # Both modes on each run's ops at their CPU seconds (`bound.cpu_replay`): on a loaded
    # machine two busy workers take CPU from each other and a one-worker phase does not, so
    # wall-time ratios between the modes measure the load as much as the schedule.
    cpu = [bound.cpu_replay(out_dir / f"{m}-{rep}", workers) for rep in range(repeats) for m in ("codesign", "sync")]
    keys = ("speedup", "util_codesign", "util_sync", "speedup_bound", "floor_frac_codesign",
            "e2e_s_codesign", "e2e_s_sync")
    cpu_replay = {k: med(c[k] for c in cpu) for k in keys}
    cpu_replay["e2e_s_codesign"] /= iterations
    cpu_replay["e2e_s_sync"] /= iterations
    cpu_replay["idle_causes_codesign"] = cpu[0]["idle_causes_codesign"]
    cpu_d = [bound.durations(bound.op_log(out_dir / f"codesign-{rep}"), "cpu") for rep in range(repeats)]
    cpu_replay["train_share"] = med(sum(v for o, v in d.items() if o.kind in ("train", "step")) / sum(d.values())
                                    for d in cpu_d)
    bound_per_repeat = [e / s["floor_s"] for e, s in zip(sync_e2e, sy, strict=True)]
    # The floor relaxes what no schedule escapes (an op's worker, the order of the ready ops), so
    # part of it may be out of any scheduler's reach: the best of a search of greedy schedules
    # with the durations known in advance says how much is reachable (`bound.best_list_schedule`).
    reachable = [e / s["best_list_s"] for e, s in zip(sync_e2e, sy, strict=True)]
    return {
        "speedup_reachable": med(reachable),
        "best_list_s_codesign": med(a["best_list_s"] for a in cd) / iterations,
        "cpu_replay": cpu_replay,
        "speedup_bound": med(bound_per_repeat),
        "speedup_bound_per_repeat": bound_per_repeat,
        "floor_s_codesign": med(a["floor_s"] for a in cd) / iterations,
        "chain_floor_s_codesign": med(a["chain_floor_s"] for a in cd) / iterations,
        "list_s_codesign": med(a["list_s"] for a in cd) / iterations,
        "floor_frac_codesign": med(a["floor_frac"] for a in cd),
        "stage_time_ratio_sync_over_codesign": med(
            s["work_floor_s"] / a["work_floor_s"] for s, a in zip(sy, cd, strict=True)),
        "idle_causes": {"codesign": cd[0]["idle_causes"],
                        "sync": bound.analyse(out_dir / "sync-0", workers, search=False)["idle_causes"]},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--quick", action="store_true", help="2 iterations, 1 repeat")
    ap.add_argument("--config", default=None, help="a config file (default: configs/default.yaml)")
    ap.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                    help="a built-in team with its pinned work (instead of --config)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--ablation", action="store_true", help="also each switch off alone")
    ap.add_argument("--also-off", action="append", default=[], metavar="SWITCH",
                    help="also the co-design with this one codesign.SWITCH off (e.g. gradient_helpers, "
                         "late_binding: the config's own switches): key ablation.SWITCH")
    ap.add_argument("--reference", action="store_true",
                    help="also the sync schedule on a shared worker pool (no static instances)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--staleness", type=int, nargs="*", default=[],
                    help="also the co-design at codesign.max_staleness=K (decoupled_ppo), per K > 0")
    ap.add_argument("--late", action="store_true",
                    help="with --staleness: also each K with late binding (keys staleness.late_k<K>)")
    ap.add_argument("--no-prefect-cost", action="store_true",
                    help="skip the plain-Dask runs that price Prefect's bookkeeping (no prefect_* keys)")
    args = ap.parse_args()
    if args.workload and args.config:
        ap.error("give --workload or --config, not both")
    name, work = WORKLOADS[args.workload or "default"]
    args.config = args.config or str(REPO / "configs" / name)
    repeats = args.repeats or (1 if args.quick else 2)
    iterations = args.iterations or (2 if args.quick else 4)

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import ensure_api

    api, _ = ensure_api()
    from flows.train import train

    all_modes = {**modes(args.ablation, args.reference), **staleness_modes(args.config, args.staleness, args.late)}
    for off in args.also_off:
        all_modes[f"ablation.{off}"] = [*all_modes["codesign"], f"codesign.{off}=false"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {m: [] for m in all_modes}
    out_dir = REPO / "runs" / ("bench-e2e" if args.workload in (None, "default") else f"bench-e2e-{args.workload}")
    t0 = time.time()
    # The machine's own figure, before the first run and after the last (it drifts).
    eff_rounds = 1 if args.quick else 2
    eff_before = None if args.quick else shortfall.parallel_efficiency(rounds=eff_rounds)
    with temporary_settings(updates={PREFECT_API_URL: api}):
        for rep in range(repeats):
            order = list(runs)
            if rep % 2:  # alternate which mode goes first
                order.reverse()
            for mode in order:
                overrides = [f"run_dir={out_dir}/{mode}-{rep}", f"train.iterations={iterations}",
                             *work, *all_modes[mode], *args.set]
                srv0 = server_cpu_s()
                state = train(args.config, overrides, progress=False, overwrite=True, return_state=True)
                srv1 = server_cpu_s()
                if not state.is_completed():
                    print(f"{mode} rep {rep} failed: {state.message}", file=sys.stderr)
                    return 1
                s = state.result()["summary"]
                s["server_cpu_s"] = (srv1 - srv0) if srv0 is not None and srv1 is not None else None
                runs[mode].append(s)
                print(f"{mode:32s} rep {rep}: {s['e2e_s_per_iteration']:.2f} s/it, "
                      f"{s['tokens_per_s']:.0f} tok/s, util {s['utilization']:.2f}, "
                      f"bookkeeping {s['prefect_overhead_frac']:.3f}", flush=True)

        # The same co-design work on plain Dask (no Prefect): the difference in total CPU is
        # Prefect's own bookkeeping; what both share (Dask's background ticks) is not.
        plain = [] if args.no_prefect_cost else [
            plain_dask_run(args.config, [f"run_dir={out_dir}/plain-dask-{rep}", f"train.iterations={iterations}",
                                         *work, *modes(False)["codesign"], *args.set])
            for rep in range(repeats)]

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    res = {
        "config": args.config, "iterations": iterations, "repeats": repeats,
        "e2e_s_codesign": med("codesign", "e2e_s_per_iteration"),
        "e2e_s_sync": med("sync", "e2e_s_per_iteration"),
        "util_codesign": med("codesign", "utilization"),
        "util_sync": med("sync", "utilization"),
        "tokens_per_s_codesign": med("codesign", "tokens_per_s"),
        "tokens_per_s_sync": med("sync", "tokens_per_s"),
        "bench_wall_s": time.time() - t0,
    }
    res["speedup"] = res["e2e_s_sync"] / res["e2e_s_codesign"]
    # Prefect's cost = the bookkeeping CPU (everything outside the stages' own work) of the
    # Prefect runs minus that of the same work on plain Dask. Differences of *total* CPU are
    # useless here: stage CPU alone moves +-7% between identical runs on this box.
    bk_prefect = statistics.median(r["bookkeeping_cpu_s"] for r in runs["codesign"])
    bk_plain = statistics.median(p["total_cpu_s"] - p["stage_cpu_s"] for p in plain) if plain else bk_prefect
    total_prefect = statistics.median(r["stage_cpu_s"] + r["bookkeeping_cpu_s"] for r in runs["codesign"])
    prefect_cpu = max(bk_prefect - bk_plain, 0.0)
    if plain:
        res["prefect_overhead_frac"] = prefect_cpu / total_prefect
        res["prefect_overhead_cpu_s_per_task"] = prefect_cpu / runs["codesign"][0]["ops"]
    srv = [r["server_cpu_s"] for r in runs["codesign"] if r.get("server_cpu_s") is not None]
    if srv and plain:
        # The API server's share too: Prefect's whole bookkeeping, not only its client side.
        server = statistics.median(srv)
        res["prefect_server_cpu_s_per_task"] = server / runs["codesign"][0]["ops"]
        res["prefect_overhead_frac_incl_server"] = (
            prefect_cpu + server) / (total_prefect + server)
    res["bookkeeping_frac_incl_dask"] = statistics.median(
        r["prefect_overhead_frac"] for r in runs["codesign"])
    res["plain_dask"] = plain
    res["tokens_per_s_ratio"] = res["tokens_per_s_codesign"] / res["tokens_per_s_sync"]
    res["balance_moves_per_run_codesign"] = med("codesign", "balance_moves")
    res["train_swaps_per_run_codesign"] = med("codesign", "train_swaps")
    res["gradient_helpers_per_run_codesign"] = med("codesign", "gradient_helpers")
    # Where the time goes on each mode's critical path (first repeat), and idle worker time.
    for m in ("codesign", "sync"):
        r0 = runs[m][0]
        res[f"critical_path_{m}"] = r0.get("critical_path", {})
        res[f"idle_frac_{m}"] = 1.0 - med(m, "utilization")
    for m in runs:
        if m.startswith("reference."):
            res[m] = {"e2e_s": med(m, "e2e_s_per_iteration"), "util": med(m, "utilization"),
                      "speedup_of_codesign": med(m, "e2e_s_per_iteration") / res["e2e_s_codesign"]}
        if m.startswith("staleness."):
            res[m] = {"e2e_s": med(m, "e2e_s_per_iteration"), "util": med(m, "utilization"),
                      "tokens_per_s": med(m, "tokens_per_s"),
                      "speedup_vs_k0": res["e2e_s_codesign"] / med(m, "e2e_s_per_iteration"),
                      "train_share": statistics.median(work_mix(out_dir / f"{m}-{rep}", iterations)["train_share"]
                                                       for rep in range(repeats))}
        if m.startswith("ablation."):
            res[m] = {"e2e_s": med(m, "e2e_s_per_iteration"),
                      "slowdown_vs_codesign": med(m, "e2e_s_per_iteration") / res["e2e_s_codesign"],
                      "util": med(m, "utilization")}
    # The measured reason when the speedup falls short: how much of the work is training
    # (which the sync baseline already runs on both workers) and the best any schedule of the
    # co-design's own work could do against the measured sync E2E.
    mixes = [work_mix(out_dir / f"codesign-{rep}", iterations) for rep in range(repeats)]
    res["train_share"] = statistics.median(m["train_share"] for m in mixes)
    res["rollout_share"] = statistics.median(m["rollout_share"] for m in mixes)
    res["ideal_s_codesign"] = statistics.median(m["ideal_s_per_it"] for m in mixes)
    # The old bound: sync E2E over the co-design run's packed stage time. It mixes two runs'
    # op times (load that changes between them moves it) and, divided into the speedup,
    # is the co-design's utilisation again.
    res["speedup_bound_cross_run"] = res["e2e_s_sync"] / res["ideal_s_codesign"]
    res.update(bounds(out_dir, repeats, iterations))
    # Within a repeat the two modes run back to back; this VM's speed drifts between repeats
    # (the same co-design work took 28.7-38.1 s/it in one bench), so the ratio within each
    # repeat, then its median, is the wall figure that drift moves least.
    res["speedup_per_repeat"] = [s["e2e_s_per_iteration"] / c["e2e_s_per_iteration"]
                                 for c, s in zip(runs["codesign"], runs["sync"], strict=True)]
    res["frac_of_bound_per_repeat"] = [sp / b for sp, b in zip(
        res["speedup_per_repeat"], res["speedup_bound_per_repeat"], strict=True)]
    res["speedup_paired"] = statistics.median(res["speedup_per_repeat"])
    res["speedup_paired_frac_of_bound"] = statistics.median(res["frac_of_bound_per_repeat"])
    res["shortfall"] = shortfall.decompose(res, eff_before, shortfall.parallel_efficiency(rounds=eff_rounds),
                                           shortfall.helper_cost(
        [out_dir / f"codesign-{rep}" for rep in range(repeats)]))
    res["idle_frac_per_worker"] = {m: idle_per_worker(out_dir / f"{m}-0") for m in ("codesign", "sync")}
    res["lengths"] = lengths(out_dir / "codesign-0")
    res["peak_rss_gib"] = {m: peak_rss_gib(out_dir / f"{m}-0") for m in ("codesign", "sync")}
    work_cd, work_sync = idle_work(out_dir / "codesign-0"), idle_work(out_dir / "sync-0")
    res["idle_work"] = work_cd
    res["wasted_decode_frac"] = {a: w["wasted_decode_frac"] for a, w in work_cd.items()}
    res["same_work"] = work_cd == work_sync
    res["runs"] = runs
    from flexmarl_core.driver.plots import load_trace, timeline

    res["timeline_png"] = str(timeline(
        [load_trace(out_dir / "sync-0", "sync"), load_trace(out_dir / "codesign-0", "co-design")],
        Path(args.json).with_suffix(".timeline.png"), title="synchronous baseline vs co-design, one time axis"))

    print(f"\n{'mode':32s} {'E2E s/it':>9s} {'tok/s':>8s} {'util':>6s}")
    for m in runs:
        print(f"{m:32s} {med(m, 'e2e_s_per_iteration'):9.2f} {med(m, 'tokens_per_s'):8.0f} "
              f"{med(m, 'utilization'):6.2f}")
    for m in ("codesign", "sync"):
        cp = res[f"critical_path_{m}"]
        parts = ", ".join(f"{k.split('/')[-1]} {v:.1f}s" for k, v in sorted(cp.items()) if k != "ops")
        print(f"critical path {m}: {parts}")
    print(f"work mix (co-design): training {100 * res['train_share']:.0f}%, rollout "
          f"{100 * res['rollout_share']:.0f}% of stage time")
    print(f"floor of the co-design's own ops: {res['floor_s_codesign']:.2f} s/it (dependency chain "
          f"{res['chain_floor_s_codesign']:.2f}), a greedy schedule of them {res['list_s_codesign']:.2f} s/it, "
          f"the best of a search {res['best_list_s_codesign']:.2f} s/it; "
          f"the co-design reached {res['floor_frac_codesign']:.2f} of its floor")
    print(f"speedup bound (sync E2E / floor of the sync run's own ops on the co-design graph): "
          f"{res['speedup_bound']:.2f}x; sync / co-design stage time {res['stage_time_ratio_sync_over_codesign']:.2f} "
          f"(1 = the same ops took as long in both runs); old cross-run bound {res['speedup_bound_cross_run']:.2f}x; "
          f"the best schedule found of the sync run's ops {res['speedup_reachable']:.2f}x")
    c = res["cpu_replay"]
    print(f"both modes replayed on these runs' ops at their CPU seconds: speedup {c['speedup']:.2f}x of a "
          f"bound {c['speedup_bound']:.2f}x; util co-design {c['util_codesign']:.2f}, sync {c['util_sync']:.2f}; "
          f"co-design at {c['floor_frac_codesign']:.2f} of its floor; training {100 * c['train_share']:.0f}% of CPU")
    for m, causes in res["idle_causes"].items():
        print(f"idle time by what the other worker ran ({m}): " + "; ".join(
            f"{w}: " + ", ".join(f"{k} {v:.0f}s" for k, v in list(c.items())[:3]) for w, c in causes.items()))
    for a, st in res["lengths"].items():
        w = work_cd.get(a, {})
        print(f"{a:10s} response tokens p50 {st['p50']:.0f} p90 {st['p90']:.0f} max {st['max']:.0f}; "
              f"decode slots wasted on finished rows {100 * w.get('wasted_decode_frac', 0):.0f}%, "
              f"zero-advantage samples skipped {w.get('skipped_samples', 0):.0f}")
    print("idle share per worker: " + "; ".join(
        f"{m} " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) for m, d in res["idle_frac_per_worker"].items()))
    print("peak RSS per worker (GiB): " + "; ".join(
        f"{m} " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) for m, d in res["peak_rss_gib"].items()))
    print(f"same work in both modes: {res['same_work']}")
    print(f"co-design: {res['balance_moves_per_run_codesign']:.0f} instance moves, "
          f"{res['train_swaps_per_run_codesign']:.0f} trainer swaps, "
          f"{res['gradient_helpers_per_run_codesign']:.0f} gradient helpers per run")
    print(f"speedup (sync / codesign E2E): {res['speedup']:.2f}x, {res['speedup'] / res['speedup_bound']:.2f} "
          f"of the bound; util co-design {res['util_codesign']:.2f}, sync {res['util_sync']:.2f}")
    res["speedup_frac_of_bound"] = res["speedup"] / res["speedup_bound"]
    print("within each repeat: speedup " + ", ".join(f"{x:.2f}x" for x in res["speedup_per_repeat"])
          + " of the bound " + ", ".join(f"{x:.2f}" for x in res["frac_of_bound_per_repeat"])
          + f"; median {res['speedup_paired']:.2f}x, {res['speedup_paired_frac_of_bound']:.2f} of the bound")
    sf = res["shortfall"]
    print(f"shortfall: speedup {res['speedup']:.2f}x ~ bound {res['speedup_bound']:.2f}x x ops ratio "
          f"{res['stage_time_ratio_sync_over_codesign']:.3f} x floor fraction {res['floor_frac_codesign']:.3f}; "
          "helper train ops cost "
          + (", ".join(f"{a} {v:.2f}x" for a, v in sf["helper_token_cost"].items()) or "-")
          + f" per token of the trainer's own ({100 * sf['helper_excess_frac']:.1f}% of stage CPU); this machine's "
          "parallel efficiency "
          f"{sf['parallel_efficiency']['mean']:.3f} (two busy cores vs one) puts a schedule that keeps "
          f"both busy under {sf['speedup_ceiling_machine']:.2f}x: reached "
          f"{sf['speedup_frac_of_machine_ceiling']:.2f} of it")
    if plain:
        print(f"Prefect bookkeeping {100 * res['prefect_overhead_frac']:.1f}% of CPU "
              f"({res['prefect_overhead_cpu_s_per_task']:.3f} CPU-s per task run; with Dask's own "
              f"background {100 * res['bookkeeping_frac_incl_dask']:.1f}%)")
    if "prefect_overhead_frac_incl_server" in res:
        print(f"with the Prefect API server's CPU: {100 * res['prefect_overhead_frac_incl_server']:.1f}% "
              f"(server {res['prefect_server_cpu_s_per_task']:.3f} CPU-s per task run)")
    Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    print(f"timeline of both modes: {res['timeline_png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
