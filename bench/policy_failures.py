"""Failures the policy caused, trained on: does the share of broken trajectories fall?

configs/program_sdk_plain.yaml: two OpenAI Agents SDK agents in sequence on the Responses model,
plain text output. An answer that runs to its token limit comes back `incomplete` and the SDK
raises `ModelBehaviorError`; flexmarl counts that as the policy's failure and trains the
trajectory's calls with `team.failure_reward` (-1 in that config) instead of dropping them.
For each start and seed, N RL iterations on a local Dask cluster (real stages, program endpoint
and store; no Prefect); per iteration, the share of trajectories the policy broke
(`team/program/policy_failed` over the iteration's trajectories), the share dropped as the
program's own failures, and the mean reward.

Starts:
    untrained  random weights (`warm_start: none`): with a 1,024-token vocabulary an answer
               ends on its own within 12 tokens about 1% of the time, both agents' about 0.01%
    sft-K      K steps of SFT on the program's demonstrations (`train.sft_max_steps=K`), a
               policy that sometimes stops in time and sometimes not

    python bench/policy_failures.py --json runs/bench/policy-failures.json [--quick]
        [--starts untrained sft-20] [--seeds 0 1 2] [--iterations 20]

`--quick`: seed 0, 3 iterations, both default starts. JSON: rows (per start and seed: the
per-iteration curve) and per start the mean share of the first and last three iterations
(`summary.<start>.share_first`, `share_last`, `falls`: the last is below the first by more than
the spread of the per-seed changes).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from _fresh import local_cluster, provenance, spread, train_run  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "program_sdk_plain.yaml"


def start_overrides(start: str) -> list[str]:
    if start == "untrained":
        return ["train.warm_start=none"]
    if start.startswith("sft-") and start[4:].isdigit():
        return ["train.warm_start=sft", f"train.sft_max_steps={start[4:]}", "train.sft_target_accuracy=1.0",
                f"train.sft_eval_every={start[4:]}", "train.sft_batch=32"]
    raise SystemExit(f"unknown start {start!r}: untrained or sft-<steps>")


def one(start: str, seed: int, iterations: int, out: Path, client) -> dict:
    cfg, _, res, wall = train_run(str(CONFIG), [f"run_dir={out / f'{start}-{seed}'}", f"seed={seed}",
                                                f"train.iterations={iterations}", "train.evaluate=false",
                                                "train.evaluate_initial=false", *start_overrides(start)], client)
    per_it = cfg.batch.inputs_per_iteration * cfg.batch.group_size
    curve = [{"iteration": i,
              "policy_failed_share": m.get("team/program/policy_failed", 0.0) / per_it,
              "dropped_share": m.get("failed_trajectories", 0.0) / per_it,
              "incomplete": m.get("team/program/policy_failed/ModelBehaviorError", 0.0),
              "accuracy": m.get("accuracy", 0.0),
              "reward": {k.split("/")[1]: v for k, v in m.items() if k.startswith("agent/") and k.endswith("/reward")}}
             for i, m in enumerate(res.iterations)]
    shares = [c["policy_failed_share"] for c in curve]
    print(f"{start:10s} seed {seed}: policy-broken share {' '.join(f'{s:.2f}' for s in shares)}  ({wall:.0f} s RL)",
          flush=True)
    return {"start": start, "seed": seed, "iterations": iterations, "trajectories_per_iteration": per_it,
            "rl_wall_s": wall, "curve": curve}


def summary(rows: list[dict]) -> dict:
    out = {}
    for start in dict.fromkeys(r["start"] for r in rows):
        rs = [r for r in rows if r["start"] == start]
        k = max(1, min(3, len(rs[0]["curve"]) // 3))
        first = [statistics.mean(c["policy_failed_share"] for c in r["curve"][:k]) for r in rs]
        last = [statistics.mean(c["policy_failed_share"] for c in r["curve"][-k:]) for r in rs]
        d = [b - a for a, b in zip(first, last, strict=True)]
        out[start] = {"seeds": [r["seed"] for r in rs], "window": k,
                      "share_first": statistics.mean(first), "share_last": statistics.mean(last),
                      "change": statistics.mean(d), "change_spread": spread(d),
                      "falls": statistics.mean(d) < 0 and -statistics.mean(d) > spread(d),
                      "dropped_total": sum(c["dropped_share"] for r in rs for c in r["curve"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--starts", nargs="+", default=["untrained", "sft-20"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--out", default="runs/bench-policy-failures")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.iterations = [0], 3
    torch.set_num_threads(1)
    out = Path(args.out).absolute()
    with provenance(REPO) as rec, local_cluster() as client:
        rows = [one(s, seed, args.iterations, out, client) for s in args.starts for seed in args.seeds]
    result = {"bench": "policy_failures", **rec, "config": str(CONFIG.relative_to(REPO)), "seeds": args.seeds, "iterations": args.iterations,
              "rows": rows, "summary": summary(rows)}
    print(f"{'start':10s} {'broken share first':>19s} {'last':>6s} {'change':>16s} {'falls':>6s}")
    for start, s in result["summary"].items():
        print(f"{start:10s} {s['share_first']:19.3f} {s['share_last']:6.3f} {s['change']:+9.3f} ± "
              f"{s['change_spread']:.3f} {s['falls']!s:>6s}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
