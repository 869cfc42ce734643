"""Agents that learn: real models, real gradients, the real store and orchestrator, in one
process (the in-process executor), on an easy reward where progress is quick."""

from __future__ import annotations

from pathlib import Path

import torch

from flexmarl_core.config import load_config
from tests._models_util import train_one_worker

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def test_mean_reward_rises_on_an_easy_reward(tmp_path):
    torch.set_num_threads(1)
    cfg = load_config(TINY, [
        f"run_dir={tmp_path}/run", "train.iterations=8", "train.evaluate=false",
        "workload.reward=tests.reward_fns:lowercase", "workload.credit=team",
        "workload.format_weight=0.0",
        "batch.inputs_per_iteration=4", "batch.group_size=8", "batch.micro_batch_inputs=2",
        *[f"team.agents.{a}.algorithm.lr=1.0e-2" for a in ("planner", "solver", "verifier")],
    ])
    _, out = train_one_worker(cfg)
    rewards = [m["agent/solver/reward"] for m in out["iterations"]]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.03, f"mean reward did not rise: {rewards}"
