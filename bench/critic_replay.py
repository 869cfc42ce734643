"""The critic's training replayed offline on a finished run's stored samples: for each setting
(learning rate, head width, epochs), a fresh critic on the base's weights is trained iteration
by iteration as a run trains it (its own values for GAE, the accumulated pass then the further
epochs, one update per micro-batch), and scored on the last iteration: per-agent squared error
and explained variance of its values against the GAE returns.

    python bench/critic_replay.py --json OUT --run RUN_DIR --base WEIGHTS [--quick]

RUN_DIR: a run folder of the default team (its store and config); WEIGHTS: the critic's base
(`model.safetensors` of the agent it copies, e.g. an SFT checkpoint's planner). JSON: per
setting `sq_error` and `explained_var` per agent, and `iterations` replayed. `--quick` replays
one setting. docs/decisions/critic-recipe.md reads it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from safetensors.torch import load_file

from flexmarl_core.algorithms.gae import explained_variance, gae_chain
from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from flexmarl_core.models import load_agent_model
from flexmarl_core.training.critic import CriticTrainer, ValueSample
from storage import MEGStore

SETTINGS = [(1e-3, 64), (1e-2, 64), (3e-2, 64), (1e-2, 0)]


def replay(run: Path, base: Path, lr: float, hidden: int, epochs: int) -> dict:
    cfg = load_config(run / "config.yaml")
    meg = MEG.from_config(cfg.team)
    agents = list(meg.trainable_agents)
    order = meg.call_order()
    model, _ = load_agent_model(cfg.agent(agents[0]).model, seed=cfg.seed)
    model.load_state_dict(load_file(str(base)))
    tr = CriticTrainer(model, hidden=hidden, per_token=False, lr=lr, max_grad_norm=cfg.critic.max_grad_norm,
                       value_clip=cfg.critic.value_clip, seed=1, agents=agents)
    store = MEGStore(cfg.resolved_store_uri())
    iterations = list(range(cfg.train.iterations))
    out: dict = {}
    for it in iterations:
        rows = [r | {"agent": a} for a in agents for r in store.read_samples(a, it).to_pylist()]
        mbs = sorted({r["mb"] for r in rows})
        target: dict[str, tuple[float, float]] = {}
        for j in mbs:
            mine = [r for r in rows if r["mb"] == j]
            vals = tr.values([ValueSample(r["prompt_ids"], r["response_ids"], r["agent"]) for r in mine])
            chains: dict = {}
            for r, v in zip(mine, vals, strict=True):
                chains.setdefault((r["input_id"], r["traj"]), []).append((order[(r["agent"], r["turn"])], r, v[0]))
            for chain in chains.values():
                chain.sort(key=lambda x: x[0])
                _, ret = gae_chain([x[1]["reward"] for x in chain], [x[2] for x in chain],
                                   gamma=cfg.critic.gamma, lam=cfg.critic.lam)
                for (_, r, v), g in zip(chain, ret, strict=True):
                    target[r["sample_id"]] = (v, g)
        if it == iterations[-1]:
            for a in agents:
                pairs = [target[r["sample_id"]] for r in rows if r["agent"] == a]
                out[a] = {"sq_error": statistics.fmean((v - g) ** 2 for v, g in pairs),
                          "explained_var": explained_variance([v for v, _ in pairs], [g for _, g in pairs])}
            break
        scale = 1.0 / len(rows)

        batches = {j: [ValueSample(r["prompt_ids"], r["response_ids"], r["agent"], [target[r["sample_id"]][0]],
                                   [target[r["sample_id"]][1]]) for r in rows if r["mb"] == j] for j in mbs}
        for j in mbs:
            tr.accumulate(batches[j], scale, key=j)
        tr.step([list(batches.items())] * (epochs - 1), scale)
    return {"lr": lr, "head_hidden": hidden, "epochs": epochs, "iterations": len(iterations), "agents": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [replay(args.run, args.base, lr, hidden, args.epochs) for lr, hidden in SETTINGS[: 1 if args.quick else None]]
    print(f"{'lr':>7} {'head':>5}  " + "  ".join(f"{a:>22}" for a in rows[0]["agents"]))
    for r in rows:
        print(f"{r['lr']:7.0e} {r['head_hidden']:5d}  " + "  ".join(
            f"err {x['sq_error']:.3f} ev {x['explained_var']:+.3f}".rjust(22) for x in r["agents"].values()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"run": str(args.run), "base": str(args.base), "settings": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
