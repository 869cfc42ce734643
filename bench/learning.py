"""Learning: does RL on the team add accuracy on top of SFT, and do the synchronous and the
co-design (async) pipelines learn equally well?

For each seed: `flexmarl sft` until the team reaches `train.sft_target_accuracy` on held-out
problems (the "SFT-only" row), then N RL iterations through the Prefect flow from those
checkpoints, once with all co-design switches off (sync) and once with all on (async);
held-out accuracy is greedy team accuracy on the same held-out problems before and after.

    python bench/learning.py --json runs/bench/learning.json [--quick] [--seeds 0 1 2]
    python bench/learning.py --json OUT --sft-from runs/bench-learning   # reuse SFT checkpoints

RL runs at 128 problems per iteration in two micro-batches of 64 (`RL_BATCH`; the default
config's 64 is sized for a short `make run`): over 25 iterations that doubled batch added
+0.016 held-out accuracy on seed 2 (+0.082 -> +0.098), and `--set` can override it.

`--sft-from DIR` skips SFT and starts RL from DIR/sft-<seed>/ckpt (what an earlier run of this
bench wrote), so RL settings can be compared on the same SFT-only starting points.
SFT checkpoints already under `--out` (a complete `sft.json`) are reused likewise.
`--sft-seed S` starts every RL seed from seed S's SFT checkpoints: the RL seed then sets the
training problems, the sampling and the held-out problems; the starting point is shared.
`--rows-from JSON` keeps an earlier run's per-seed results and runs only the modes it lacks.
Held-out accuracy is measured on `--heldout` problems (default 512, ~10 s of greedy decoding):
at the config's 128 one measurement is +-0.04, as large as the effect being measured.

Mode `k1` (`--modes async k1`): the async pipeline with bounded staleness
`codesign.max_staleness=1` and every agent on `decoupled_ppo`, from the same SFT checkpoints
(`acc_k1`; k = 0 is `async`). A LoRA team is the same bench with `--set` giving every agent
`model={base: tiny-1m, lora: {...}}` (its SFT then trains the one shared base).

JSON: team, config, acc_sft, acc_rl (= acc_async), acc_sync, acc_async, acc_k1 (fractions, mean
over seeds), gain (= gain_async, else gain_sync), gain_<mode> (mean over seeds of RL minus that
seed's SFT-only), sync_minus_async per seed run in both modes, seeds, iterations, and per-seed
rows (acc_sft, acc_<mode>, gain_<mode>, sft_steps, seconds). `--sync-seeds 0` adds the sync
mode on seed 0 only, to check async == sync without paying for it on every seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SWITCHES = ["dependency_parallel", "load_balancing", "async_pipeline", "on_demand_allocation"]
RL_BATCH = ["batch.inputs_per_iteration=128", "batch.micro_batch_inputs=64"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="1 seed, fewer iterations, async only")
    ap.add_argument("--config", default=str(REPO / "configs" / "default.yaml"))
    ap.add_argument("--seeds", type=int, nargs="*", default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--modes", nargs="*", default=None, choices=["sync", "async", "k1"])
    ap.add_argument("--sync-seeds", type=int, nargs="*", default=[], metavar="SEED",
                    help="also run the sync mode on these seeds (async == sync check on a few seeds)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--sft-from", default=None, metavar="DIR",
                    help="reuse SFT checkpoints DIR/sft-<seed>/ckpt instead of running SFT")
    ap.add_argument("--heldout", type=int, default=512,
                    help="held-out problems for the before/after accuracy (workload.heldout_size)")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-learning"), metavar="DIR",
                    help="run folders go here (default: runs/bench-learning)")
    ap.add_argument("--sft-seed", type=int, default=None, metavar="S",
                    help="every RL seed starts from seed S's SFT checkpoints (default: its own)")
    ap.add_argument("--rows-from", default=None, metavar="JSON",
                    help="an earlier JSON of this bench: its per-seed results are kept and the "
                    "modes it has are not run again (resume, or add a mode to a finished run)")
    args = ap.parse_args()
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    iterations = args.iterations or (6 if args.quick else 25)
    run_modes = args.modes or (["async"] if args.quick else ["sync", "async"])

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import ensure_api
    from flexmarl_core.config import load_config
    from flexmarl_core.sft import run_sft

    api, _ = ensure_api()
    from flows.train import train

    out_dir = Path(args.out).resolve()
    sft_root = Path(args.sft_from).resolve() if args.sft_from else out_dir
    earlier = {r["seed"]: r for r in json.loads(Path(args.rows_from).read_text())["rows"]} if args.rows_from else {}
    rows = []
    t0 = time.time()
    for seed in seeds:
        base = [f"seed={seed}", f"workload.heldout_size={args.heldout}", *args.set]
        sft_seed = seed if args.sft_seed is None else args.sft_seed
        ckpt = sft_root / f"sft-{sft_seed}" / "ckpt"
        meta = ckpt / "sft.json"
        if seed in earlier:
            row = dict(earlier[seed])
        elif meta.is_file():  # made by an earlier run (or seed) of this bench: reused
            row = {"seed": seed, "sft_steps": json.loads(meta.read_text())["steps"], "sft_s": 0.0,
                   "sft_from": str(ckpt)}
        elif args.sft_from:
            print(f"--sft-from: no SFT checkpoint for seed {sft_seed} at {ckpt}", file=sys.stderr)
            return 1
        else:
            cfg = load_config(args.config, [f"seed={sft_seed}", *base[1:], f"run_dir={out_dir}/sft-{sft_seed}"])
            ts = time.time()
            sft = run_sft(cfg, out_dir=ckpt, log=lambda m: print(m, flush=True))
            row = {"seed": seed, "sft_steps": sft["steps"], "sft_s": time.time() - ts}
        row["sft_seed"] = sft_seed
        rows.append(row)
        modes = run_modes + (["sync"] if seed in args.sync_seeds and "sync" not in run_modes else [])
        for mode in modes:
            if f"acc_{mode}" in row:
                print(f"seed {seed} {mode}: kept from {args.rows_from}", flush=True)
                continue
            value = "false" if mode == "sync" else "true"
            overrides = [*RL_BATCH, *base, f"run_dir={out_dir}/{mode}-{seed}", f"train.iterations={iterations}",
                         f"train.init_from={ckpt}", "train.evaluate_initial=true",
                         *[f"codesign.{s}={value}" for s in SWITCHES]]
            if mode == "k1":
                agents = [a.name for a in load_config(args.config, base).team.agents]
                overrides += ["codesign.max_staleness=1",
                              *[f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in agents]]
            tr = time.time()
            with temporary_settings(updates={PREFECT_API_URL: api}):
                state = train(args.config, overrides, progress=False, return_state=True)
            if not state.is_completed():
                print(f"seed {seed} {mode} failed: {state.message}", file=sys.stderr)
                return 1
            s = state.result()["summary"]
            # SFT-only accuracy is measured by the same evaluation on the same problems.
            row["acc_sft"] = s["initial_heldout_accuracy"]
            row[f"acc_{mode}"] = s["heldout_accuracy"]
            row[f"gain_{mode}"] = row[f"acc_{mode}"] - row["acc_sft"]
            row[f"{mode}_s"] = time.time() - tr
            print(f"seed {seed} {mode}: SFT-only {row['acc_sft']:.3f} -> RL {row[f'acc_{mode}']:.3f} "
                  f"({iterations} iterations, {row[f'{mode}_s']:.0f} s)", flush=True)

    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else None

    res = {"config": args.config, "team": load_config(args.config, []).name, "seeds": seeds, "iterations": iterations, "heldout": args.heldout, "overrides": args.set,
           "acc_sft": mean("acc_sft"), "acc_sync": mean("acc_sync"), "acc_async": mean("acc_async"),
           "acc_k1": mean("acc_k1"),
           "bench_wall_s": time.time() - t0, "rows": rows}
    res["acc_rl"] = res["acc_async"] if res["acc_async"] is not None else res["acc_sync"]
    # Mean over seeds of each seed's own gain (RL minus its SFT start), per mode.
    for mode in ("sync", "async", "k1"):
        res[f"gain_{mode}"] = mean(f"gain_{mode}")
    res["gain"] = res["gain_async"] if res["gain_async"] is not None else res["gain_sync"]
    # The co-design's samples equal sync's and its weights agree within 1e-4 per step; over
    # many iterations one flipped sampled token lets the runs drift apart, so this is a
    # difference to read against the held-out noise, not a bit-equality check.
    res["sync_minus_async"] = {r["seed"]: r["acc_sync"] - r["acc_async"]
                               for r in rows if "acc_async" in r and "acc_sync" in r}
    print(f"\n{'seed':>4s} {'SFT-only':>9s} {'sync':>7s} {'async':>7s} {'k1':>7s}")
    for r in rows:
        print(f"{r['seed']:4d} {r['acc_sft']:9.3f} {r.get('acc_sync', float('nan')):7.3f} "
              f"{r.get('acc_async', float('nan')):7.3f} {r.get('acc_k1', float('nan')):7.3f}")
    print(f"mean: SFT-only {res['acc_sft']:.3f}, RL {res['acc_rl']:.3f} (gain {res['gain'] if res['gain'] is not None else float('nan'):+.3f})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
