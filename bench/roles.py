"""Role-specific policies against one shared policy, on a game whose seats differ.

The ultimatum game (examples/envs/ultimatum.py, configs/env_ultimatum.yaml): a proposer offers
k of 4 coins, a responder accepts or rejects. For each seed, from an SFT start on legal play,
N RL iterations on a local Dask cluster (real stages, store and scheduler; no Prefect), in two
conditions:

    roles    alice proposes, bob responds, each its own model learning from its own answers
             (PettingLLMs' role-specific policies)
    shared   one model plays both seats, told which by the observation (SPIRAL's shape)

Before RL (version 0) and after it (version N) the policy is read from the models exactly: the
probability each gives every legal answer at the 6 decision points (one offer, five replies),
and the game is scored exactly from it (`examples/envs/ultimatum.py` `evaluate`): NashConv (0 at
an equilibrium), each seat's expected share, the accept rate and the mean offer. For the roles
condition, the same figures with the models swapped (alice responds, bob proposes): PettingLLMs'
ablation of whether each model learned its own role.

    python bench/roles.py --json runs/bench/roles.json [--quick] [--seeds 0 1 2] [--iterations 30]

`--quick`: seed 0, 3 iterations, both conditions. JSON: rows (per condition and seed: before,
after, and for roles after_swapped) and per condition the means and spreads (std over seeds);
`summary.<condition>.falls_beyond_spread`: NashConv's mean change is below zero by more than
its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from _fresh import local_cluster, provenance, spread, train_run  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "env_ultimatum.yaml"
SFT = ["train.warm_start=sft", "train.sft_target_accuracy=1.0", "train.sft_max_steps=100",
       "train.sft_eval_every=50", "train.sft_batch=32"]
FIGURES = ("nash_conv", "gain_proposer", "gain_responder", "value_proposer", "value_responder",
           "accept_rate", "offer_mean")


def condition(name: str) -> dict:
    data = yaml.safe_load(CONFIG.read_text())
    team = data["team"]
    if name == "shared":
        team["agents"] = [{**team["agents"][0], "name": "player"}]
        team["output"] = "player"
        team["environment"]["seats"] = {"proposer": "player", "responder": "player"}
        data["cluster"]["workers"] = [{"name": w, "resources": {"rollout:player": 1, "train": 1}}
                                      for w in ("w0", "w1")]
    elif name != "roles":
        raise SystemExit(f"unknown condition {name!r}: roles or shared")
    return data


def measure(cfg, run_dir: Path, version: int, swap: bool = False) -> dict:
    """The exact figures of the team's policy at `version` (`swap`: each model in the other seat)."""
    from examples.envs.ultimatum import evaluate, infosets
    from flexmarl_core.models import load_agent_model
    from flexmarl_core.runfiles.weights import load_weights
    from flexmarl_core.teams.environment import EnvironmentTeam

    team = EnvironmentTeam(cfg)
    seat_agent = {s: c.agent for s, c in team.ecfg.seats.items()}
    if swap:
        seat_agent = {"proposer": seat_agent["responder"], "responder": seat_agent["proposer"]}
    models = {}
    for agent in team.meg.agent_names:
        model, _ = load_agent_model(cfg.agent(agent).model, seed=cfg.seed)
        model.load_state_dict(load_weights(run_dir, agent, version))
        models[agent] = model.eval()

    def probs(seat: str, obs: str, legal: tuple[str, ...]) -> list[float]:
        agent = seat_agent[seat]
        return team.action_probs(agent, models[agent], obs, legal)

    coins = int(cfg.team.environment.options.get("coins", 4))
    return {**evaluate(probs, coins),
            "probs": {f"{seat}: {obs.rsplit(chr(10), 1)[0][-60:]}": [round(x, 4) for x in probs(seat, obs, legal)]
                      for seat, obs, legal in infosets(coins)}}


def one(name: str, seed: int, iterations: int, out: Path, client) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(condition(name), f)
    cfg, folder, res, wall = train_run(f.name, [f"run_dir={out / f'{name}-{seed}'}", f"seed={seed}",
                                                f"train.iterations={iterations}", "train.evaluate=false",
                                                "train.evaluate_initial=false", *SFT], client)
    before, after = measure(cfg, folder, 0), measure(cfg, folder, iterations)
    last = res.iterations[-1]
    row = {"condition": name, "seed": seed, "iterations": iterations, "rl_wall_s": wall,
           "before": before, "after": after,
           "delta_nash_conv": after["nash_conv"] - before["nash_conv"],
           "invalid_last_iteration": last.get("team/env/invalid", 0.0) / max(last.get("team/env/episodes", 1.0), 1.0)}
    if name == "roles":
        row["after_swapped"] = measure(cfg, folder, iterations, swap=True)
    swapped = f"  swapped {row['after_swapped']['nash_conv']:.3f}" if "after_swapped" in row else ""
    print(f"{name:7s} seed {seed}: NashConv {before['nash_conv']:.3f} -> {after['nash_conv']:.3f}{swapped}"
          f"  proposer {before['value_proposer']:.3f} -> {after['value_proposer']:.3f}"
          f"  responder {before['value_responder']:.3f} -> {after['value_responder']:.3f}"
          f"  accept {before['accept_rate']:.2f} -> {after['accept_rate']:.2f}  ({wall:.0f} s RL)", flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["condition"] for r in rows):
        rs = [r for r in rows if r["condition"] == name]
        s: dict = {"seeds": [r["seed"] for r in rs]}
        for when in ("before", "after", "after_swapped"):
            if all(when in r for r in rs):
                for key in FIGURES:
                    s[f"{key}_{when}"] = statistics.mean(r[when][key] for r in rs)
                s[f"nash_conv_{when}_spread"] = spread([r[when]["nash_conv"] for r in rs])
        d = [r["delta_nash_conv"] for r in rs]
        s["delta_nash_conv"], s["delta_spread"] = statistics.mean(d), spread(d)
        s["invalid_last_iteration"] = statistics.mean(r["invalid_last_iteration"] for r in rs)
        s["falls_beyond_spread"] = s["delta_nash_conv"] < 0 and -s["delta_nash_conv"] > s["delta_spread"]
        out[name] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--conditions", nargs="+", default=["roles", "shared"])
    ap.add_argument("--out", default="runs/bench-roles")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.iterations = [0], 3
    sys.path.insert(0, str(REPO))  # examples/ is importable from the repository root
    torch.set_num_threads(1)
    out = Path(args.out).absolute()
    with provenance(REPO) as rec, local_cluster() as client:
        rows = [one(c, s, args.iterations, out, client) for c in args.conditions for s in args.seeds]
    result = {"bench": "roles", "game": "ultimatum (4 coins)", **rec, "seeds": args.seeds, "iterations": args.iterations, "rows": rows, "summary": summary(rows),
              "uniform_random_nash_conv": 0.5}
    print(f"{'condition':9s} {'NashConv before':>16s} {'after':>7s} {'change':>16s} {'swapped':>8s} {'beyond spread':>14s}")
    for name, s in result["summary"].items():
        swapped = f"{s['nash_conv_after_swapped']:8.3f}" if "nash_conv_after_swapped" in s else f"{'-':>8s}"
        print(f"{name:9s} {s['nash_conv_before']:16.3f} {s['nash_conv_after']:7.3f} "
              f"{s['delta_nash_conv']:+9.3f} ± {s['delta_spread']:.3f} {swapped} {s['falls_beyond_spread']!s:>14s}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
