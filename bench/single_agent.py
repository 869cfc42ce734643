"""Ahead of a single-agent loop: one agent's GRPO of fine-grained steps, asynchronous on two
one-thread workers against the best on-policy schedule on one two-thread worker.

    python bench/single_agent.py --json OUT [--quick] [--seeds 0 1 2] [--iterations 150]

The work is `configs/overhead.yaml`'s size (one agent, a 1.1M-parameter model, 8 prompts x G 8
completions of at most 8 tokens per step) on a problem set large enough to measure held-out
accuracy to +-0.02 (`WORKLOAD`: a + b and a - b below 50, 512 held-out problems; the overhead
config's numbers below 10 leave only ~40 held-out problems). For each seed: SFT until
`train.sft_target_accuracy` (as `bench/learning.py`), then the same RL iterations from that
checkpoint under each schedule:

- `sync` and `async` (k = 0): one worker `{rollout: 1, train: 1}` with 2 torch threads, all
  co-design switches off / on. Both are on-policy; the faster per seed is `on_policy`.
- `k1`: two workers of 1 torch thread each, `codesign.max_staleness=1` with `decoupled_ppo`,
  late binding and partial rollouts: iteration i+1's rollouts run beside iteration i's training.

Keys: `tokens_per_s_<schedule>` (generated tokens over the iterations' span, the run's
`tokens_per_s`), `acc_<schedule>` and `acc_sft` (greedy held-out accuracy), `ratio`
(tokens/s of k1 over on_policy, mean over seeds of each seed's ratio), `diff_acc` (acc_k1 minus
acc_on_policy, mean over seeds), `seeds`, `iterations` and per-seed `rows`. `--quick`: one
seed, 30 iterations. Partial rollouts only act on a generation longer than the engine's look
interval (16 tokens), so at 8 tokens they are switched on but never resume.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from learning import sft_checkpoint

from flexmarl_core.config import SWITCHES, switch_overrides

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "overhead.yaml")
WORKLOAD = ["workload.params={n_operands: 2, max_value: 49, ops: '+-', max_result: 99, heldout_fraction: 0.2}",
            # the overhead config samples at T = 1.0, where RL of this size loses accuracy
            "team.agents.solver.sampling.temperature=0.5"]
ONE_WORKER = ["cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}]", "cluster.torch_threads=2"]
TWO_WORKERS = ["cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}},"
               " {name: w1, resources: {rollout: 1, train: 1}}]", "cluster.torch_threads=1"]
SCHEDULES: dict[str, list[str]] = {
    "sync": [*ONE_WORKER, *switch_overrides(off=SWITCHES)],
    "async": [*ONE_WORKER, *switch_overrides(on=SWITCHES)],
    "k1": [*TWO_WORKERS, *switch_overrides(on=SWITCHES), "codesign.max_staleness=1",
           "codesign.late_binding=true", "codesign.partial_rollouts=true",
           "team.agents.solver.algorithm.policy_loss=decoupled_ppo"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="1 seed, 30 iterations")
    ap.add_argument("--seeds", type=int, nargs="*", default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--heldout", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-single-agent"), metavar="DIR")
    args = ap.parse_args()
    args.config = CONFIG  # what sft_checkpoint reads
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    iterations = args.iterations or (30 if args.quick else 150)

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import ensure_api

    api, _ = ensure_api()
    from flows.train import train

    out_dir = Path(args.out).resolve()
    rows: list[dict] = []
    t0 = time.time()
    for seed in seeds:
        base = [f"seed={seed}", f"workload.heldout_size={args.heldout}", *WORKLOAD, *args.set]
        ckpt = out_dir / f"sft-{seed}" / "ckpt"
        row: dict = {"seed": seed, **{f"sft_{k}": v for k, v in sft_checkpoint(args, out_dir, ckpt, base).items()}}
        rows.append(row)
        for name, sched in SCHEDULES.items():
            overrides = [*base, *sched, f"run_dir={out_dir}/{name}-{seed}", f"train.iterations={iterations}",
                         f"train.init_from={ckpt}", "train.evaluate=true", "train.evaluate_initial=true",
                         f"train.checkpoint_every={iterations}"]
            with temporary_settings(updates={PREFECT_API_URL: api}):
                state = train(CONFIG, overrides, progress=False, overwrite=True, return_state=True)
            if not state.is_completed():
                print(f"seed {seed} {name} failed: {state.message}", file=sys.stderr)
                return 1
            s = state.result()["summary"]
            row["acc_sft"] = s["initial_heldout_accuracy"]
            row[f"acc_{name}"] = s["heldout_accuracy"]
            row[f"tokens_per_s_{name}"] = s["tokens_per_s"]
            print(f"seed {seed} {name}: {s['tokens_per_s']:.0f} tokens/s, held-out "
                  f"{s['initial_heldout_accuracy']:.3f} -> {s['heldout_accuracy']:.3f}", flush=True)
        best = max(("sync", "async"), key=lambda m: row[f"tokens_per_s_{m}"])
        row.update(on_policy=best, acc_on_policy=row[f"acc_{best}"],
                   tokens_per_s_on_policy=row[f"tokens_per_s_{best}"])
        row["ratio"] = row["tokens_per_s_k1"] / row["tokens_per_s_on_policy"]
        row["diff_acc"] = row["acc_k1"] - row["acc_on_policy"]
    res = summarise(rows, seeds, iterations, args.heldout, time.time() - t0)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"\n{'seed':>5s} {'on-policy':>10s} {'tok/s':>8s} {'k1 tok/s':>9s} {'ratio':>6s} "
          f"{'acc sft':>8s} {'acc on':>7s} {'acc k1':>7s}")
    for r in rows:
        print(f"{r['seed']:>5d} {r['on_policy']:>10s} {r['tokens_per_s_on_policy']:8.0f} {r['tokens_per_s_k1']:9.0f} "
              f"{r['ratio']:6.2f} {r['acc_sft']:8.3f} {r['acc_on_policy']:7.3f} {r['acc_k1']:7.3f}")
    print(f"ratio {res['ratio']:.2f} (target >= 1.2), diff_acc {res['diff_acc']:+.3f} (target within 0.01)")
    return 0


def summarise(rows: list[dict], seeds: list[int], iterations: int, heldout: int, wall_s: float) -> dict:
    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    keys = ["acc_sft", *(f"{p}_{m}" for m in (*SCHEDULES, "on_policy") for p in ("acc", "tokens_per_s"))]
    return {"config": CONFIG, "workload": WORKLOAD, "seeds": seeds, "iterations": iterations, "heldout": heldout,
            **{k: mean(k) for k in keys}, "ratio": mean("ratio"), "diff_acc": mean("diff_acc"),
            "bench_wall_s": wall_s, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
