"""Headroom of an SFT start for RL: greedy held-out accuracy against pass@k at the sampling
temperature, per problem length (the workload's `steps` meta, when it has one).

RL sharpens what sampling already finds: where pass@k is close to greedy there is little for
it to gain, and where pass@k is far above greedy a policy that samples the right chain more
often also decodes it greedily more often. Each of the k samples is a whole team chain (every
agent samples at its own `sampling`, as in a rollout); per-agent columns are the share of
problems on which at least one of the k chains had that agent's own score at 1.

    python bench/headroom.py --config configs/longtail_learn.yaml --ckpt runs/ll/sft-0/ckpt \
        --heldout 256 --k 8 [--set workload.params.max_steps=4] [--json OUT]
    python bench/headroom.py --config C --ckpt RUN_DIR --version 10 ...   # a run's weights after RL
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def team_samples(team, workload, engines, problems, seed: int, k: int, batch: int) -> list[list[dict]]:
    """k sampled team chains per problem: outputs[i][j] is chain j of problem i (the held-out
    evaluation's team rollout, every agent sampling, in batches grouped by question length)."""
    from flexmarl_core.driver.evaluate import evaluate_team

    copies = [p for p in problems for _ in range(k)]
    outs = evaluate_team(team, workload, engines, copies, seed=seed, batch=batch, greedy=False)["outputs"]
    return [outs[i * k:(i + 1) * k] for i in range(len(problems))]


def agent_weights(ckpt: Path, agent: str, version: int | None) -> dict:
    """An SFT checkpoint's weights (`<ckpt>/<agent>`), or with `version` a run folder's published
    version (v0 for an agent that published no later one: a frozen agent)."""
    from flexmarl_core.runfiles.location import as_location, weights_key
    from flexmarl_core.runfiles.weights import initial_weights, load_weights

    if version is None:
        return initial_weights(str(ckpt), agent)
    have = as_location(ckpt).exists(weights_key(agent, version))
    return load_weights(ckpt, agent, version if have else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--ckpt", required=True,
                    help="folder of <agent>/model.safetensors, or with --version a run folder")
    ap.add_argument("--version", type=int, default=None,
                    help="a run's weights/<agent>/v<N>.safetensors (v0 for an agent that has no vN: frozen)")
    ap.add_argument("--heldout", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="chains decoded at once")
    ap.add_argument("--set", action="append", default=[], help="config overrides")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from flexmarl_core.config import load_config
    from flexmarl_core.driver.evaluate import evaluate_team
    from flexmarl_core.inference import make_inference_engine
    from flexmarl_core.models import load_agent_model
    from flexmarl_core.teams import team_shape
    from flexmarl_core.workloads import make_workload

    cfg = load_config(args.config, args.set)
    torch.manual_seed(cfg.seed)
    team = team_shape(cfg)
    wl = make_workload(cfg.workload, cfg.team)
    engines = {}
    for a in cfg.team.agents:
        model, tok = load_agent_model(a.model, seed=cfg.seed)
        model.load_state_dict(agent_weights(Path(args.ckpt), a.name, args.version))
        model.eval()
        engines[a.name] = make_inference_engine(a, model, tok)
    probs = wl.problems("heldout", args.heldout, seed=cfg.seed)
    t0 = time.process_time()
    greedy = evaluate_team(team, wl, engines, probs, seed=cfg.seed, batch=cfg.train.eval_batch)
    t_greedy = time.process_time() - t0
    samples = team_samples(team, wl, engines, probs, cfg.seed, args.k, args.batch)
    t_sample = time.process_time() - t0 - t_greedy
    agents = [a.name for a in cfg.team.agents]

    def bucket(p) -> str:
        s = p.meta.get("steps")
        return "all" if s is None else (f"{s}" if s < 10 else "10+")

    stats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for p, g, chains in zip(probs, greedy["outputs"], samples, strict=True):
        for key in (bucket(p), "total"):
            st = stats[key]
            st["n"] += 1
            st["greedy"] += wl.is_correct(p, g)
            hits = [wl.is_correct(p, c) for c in chains]
            st["pass@k"] += any(hits)
            st["sample_mean"] += sum(hits) / len(hits)
            for a in agents:
                st[f"greedy_{a}"] += (wl.agent_score(p, a, g) or 0.0) >= 1.0
                st[f"pass_{a}"] += any((wl.agent_score(p, a, c) or 0.0) >= 1.0 for c in chains)
    table = {key: {c: (v if c == "n" else v / st["n"]) for c, v in st.items()} for key, st in stats.items()}
    order = sorted((k for k in table if k not in ("total", "10+", "all")), key=int) + \
        [k for k in ("10+", "all", "total") if k in table]
    head = ["n", "greedy", f"pass@{args.k}", "sample_mean"] + [f"{w}_{a}" for a in agents for w in ("greedy", "pass")]
    print(f"{'steps':>6s} " + " ".join(f"{h:>15s}" for h in head))
    for key in order:
        row = table[key]
        vals = [row["n"], row["greedy"], row["pass@k"], row["sample_mean"]] + \
            [row[f"{w}_{a}"] for a in agents for w in ("greedy", "pass")]
        print(f"{key:>6s} " + " ".join(f"{v:15.0f}" if i == 0 else f"{v:15.3f}" for i, v in enumerate(vals)))
    print(f"CPU s: greedy {t_greedy:.0f}, {args.k} samples {t_sample:.0f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": args.config, "ckpt": args.ckpt, "overrides": args.set,
                                               "k": args.k, "heldout": args.heldout, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
