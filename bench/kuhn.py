"""Kuhn poker with a ground truth: does RL on an environment team move the learned policy
toward Nash, and how does that compare with a frozen opponent and with one shared policy?

For each seed, the two-seat team of configs/env_kuhn.yaml starts from SFT on legal play (random
legal moves, `EnvironmentTeam.demonstrations`), then N RL iterations on a local Dask cluster
(real stages, store and scheduler; no Prefect), in three conditions:

    selfplay  alice plays player_0, bob player_1, both train from their own samples
    frozen    alice trains; bob plays at his SFT start (`frozen: true`), never learning
    shared    one agent plays both seats, told which by the observation (SPIRAL's shape)

Before RL (version 0) and after it (version N), the policy is read from the models exactly:
at each of Kuhn poker's 12 decision points, the probability each model gives `[pass]` and
`[bet]` after the prompt the seat sees, normalised over the two (`action_probs`). From that
policy OpenSpiel computes exploitability (0 at Nash, 0.4583 for uniform random), each seat's
expected value against uniform random play and its win rate (`flexmarl_core/envs/kuhn.py`).

    python bench/kuhn.py --json runs/bench/kuhn.json [--quick] [--seeds 0 1 2] [--iterations 30]

`--quick`: seed 0, selfplay only, 6 iterations. JSON: rows (per condition and seed: before and
after), and per condition the mean and spread (std over seeds) of exploitability before and
after and of its change; `summary.falls_beyond_spread` per condition: the mean change is below
zero by more than the spread of the changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import yaml
from _fresh import local_cluster, provenance, spread, train_run  # bench/ is this script's folder

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "env_kuhn.yaml"
SFT = ["train.warm_start=sft", "train.sft_target_accuracy=1.0", "train.sft_max_steps=100",
       "train.sft_eval_every=50", "train.sft_batch=32"]


def condition(name: str, render: str | None = None) -> dict:
    """configs/env_kuhn.yaml, changed for condition `name` (and `options.render`)."""
    data = yaml.safe_load(CONFIG.read_text())
    team = data["team"]
    if render:
        team["environment"]["options"] = {"render": render}
    if name == "frozen":  # bob plays at his SFT start, never learning
        team["environment"]["seats"]["player_1"] = {"agent": "bob", "frozen": True}
    elif name == "shared":
        agent = {**team["agents"][0], "name": "player"}
        team["agents"] = [agent]
        team["output"] = "player"
        team["environment"]["seats"] = {"player_0": "player", "player_1": "player"}
        data["cluster"]["workers"] = [{"name": "w0", "resources": {"rollout:player": 1, "train": 1}},
                                      {"name": "w1", "resources": {"rollout:player": 1, "train": 1}}]
    return data


def policy(team, models: dict[str, object]):
    """probs(seat, observation, legal) of the seats' models (`models`: seat -> model)."""
    seats = {s: c.agent for s, c in team.ecfg.seats.items()}
    return lambda seat, obs, legal: team.action_probs(seats[seat], models[seat], obs, legal)


def measure(cfg, run_dir: Path, version: int) -> dict:
    """Exploitability, value and win rate against random play of the team's policy at
    `version` of every agent (a frozen one stays at 0)."""
    from flexmarl_core.envs import kuhn
    from flexmarl_core.models import load_agent_model
    from flexmarl_core.runfiles.weights import load_weights
    from flexmarl_core.teams.environment import EnvironmentTeam

    team = EnvironmentTeam(cfg)
    models, frozen = {}, {}
    for agent in team.meg.agent_names:
        for v, into in ((version if cfg.agent(agent).trainable else 0, models), (0, frozen)):
            model, _ = load_agent_model(cfg.agent(agent).model, seed=cfg.seed)
            model.load_state_dict(load_weights(run_dir, agent, v))
            into[agent] = model.eval()
    seats = {s: frozen[c.agent] if c.frozen else models[c.agent] for s, c in team.ecfg.seats.items()}
    probs = policy(team, seats)
    render = team.env.render  # what the seats were shown: the config's `options.render`, if any
    return {"exploitability": kuhn.exploitability(probs, render),
            **{f"value_vs_random_{s}": kuhn.value_vs_random(probs, s, render) for s in kuhn.SEATS},
            **{f"win_rate_vs_random_{s}": kuhn.win_rate_vs_random(probs, s, render) for s in kuhn.SEATS},
            "probs": {f"{seat} {obs}": [round(x, 4) for x in probs(seat, obs, legal)]
                      for seat, obs, legal in kuhn.kuhn_infosets(render)}}


def one(name: str, seed: int, iterations: int, out: Path, client, render: str | None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(condition(name, render), f)
    run_dir = out / f"{name}-{seed}{'-' + render.rsplit(':', 1)[1] if render else ''}"
    cfg, folder, res, wall = train_run(f.name, [f"run_dir={run_dir}", f"seed={seed}", f"train.iterations={iterations}",
                                                "train.evaluate=false", "train.evaluate_initial=false", *SFT], client)
    before, after = measure(cfg, folder, 0), measure(cfg, folder, iterations)
    last = res.iterations[-1]
    row = {"condition": name, "seed": seed, "render": render or "default", "iterations": iterations, "rl_wall_s": wall, "before": before,
           "after": after, "delta_exploitability": after["exploitability"] - before["exploitability"],
           "invalid_last_iteration": last.get("team/env/invalid", 0.0) / max(last.get("team/env/episodes", 1.0), 1.0),
           "train_win_rate_last_iteration": last["accuracy"]}
    print(f"{name:9s} seed {seed}: exploitability {before['exploitability']:.4f} -> {after['exploitability']:.4f}"
          f"  p0 vs random {before['value_vs_random_player_0']:+.3f} -> {after['value_vs_random_player_0']:+.3f}"
          f"  p1 vs random {before['value_vs_random_player_1']:+.3f} -> {after['value_vs_random_player_1']:+.3f}"
          f"  ({wall:.0f} s RL)", flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["condition"] for r in rows):
        rs = [r for r in rows if r["condition"] == name]
        d = [r["delta_exploitability"] for r in rs]
        s = {"seeds": [r["seed"] for r in rs],
             "exploitability_before": statistics.mean(r["before"]["exploitability"] for r in rs),
             "exploitability_after": statistics.mean(r["after"]["exploitability"] for r in rs),
             "spread_after": spread([r["after"]["exploitability"] for r in rs]),
             "delta": statistics.mean(d), "delta_spread": spread(d)}
        for key in ("value_vs_random_player_0", "value_vs_random_player_1",
                    "win_rate_vs_random_player_0", "win_rate_vs_random_player_1"):
            s[f"{key}_before"] = statistics.mean(r["before"][key] for r in rs)
            s[f"{key}_after"] = statistics.mean(r["after"][key] for r in rs)
        s["falls_beyond_spread"] = s["delta"] < 0 and -s["delta"] > s["delta_spread"]
        out[name] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--conditions", nargs="+", default=["selfplay", "frozen", "shared"])
    ap.add_argument("--out", default="runs/bench-kuhn")
    ap.add_argument("--render", default=None, help="team.environment.options.render, e.g. "
                    "flexmarl_core.envs.openspiel:render_kuhn_short (default: the adapter's own)")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.iterations, args.conditions = [0], 6, ["selfplay"]
    torch.set_num_threads(1)
    out = Path(args.out).absolute()
    with provenance(REPO) as rec, local_cluster() as client:
        rows = [one(c, s, args.iterations, out, client, args.render) for c in args.conditions for s in args.seeds]
    result = {"bench": "kuhn", **rec, "seeds": args.seeds, "iterations": args.iterations, "render": args.render or "default",
              "rows": rows, "summary": summary(rows),
              "uniform_random_exploitability": 0.4583333333333333, "nash_value_player_0": -1 / 18}
    print(f"{'condition':9s} {'exploitability before':>22s} {'after':>8s} {'change':>16s} {'beyond spread':>14s}")
    for name, s in result["summary"].items():
        print(f"{name:9s} {s['exploitability_before']:22.4f} {s['exploitability_after']:8.4f} "
              f"{s['delta']:+9.4f} ± {s['delta_spread']:.4f} {s['falls_beyond_spread']!s:>14s}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
