"""Agents learn, as a mechanism: one iteration through the real stages, store and orchestrator
(in one process, the in-process executor) moves each agent's weights so that its own samples'
advantage-weighted log-probability rises. That is what a policy-gradient step does to first
order, whatever the tiny model happens to sample on this CPU; how much a team gains over a run
is a measured result (docs/results), not a test."""

from __future__ import annotations

from pathlib import Path

import torch

from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from flexmarl_core.runtime.worker import load_weights
from flexmarl_core.training import Sample
from storage import MEGStore
from tests._models_util import tiny_model, train_one_worker, trainer

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_one_update_raises_the_advantage_weighted_logprob_of_its_samples(tmp_path):
    cfg = load_config(TINY, [
        f"run_dir={tmp_path}/run", "train.iterations=1", "train.evaluate=false",
        "workload.reward=tests.reward_fns:lowercase", "workload.credit=team",
        "workload.format_weight=0.0", "batch.inputs_per_iteration=4", "batch.group_size=8",
        "batch.micro_batch_inputs=2",
    ])
    run_dir, _ = train_one_worker(cfg)
    store = MEGStore(cfg.resolved_store_uri())
    for agent in MEG.from_config(cfg.team).trainable_agents:
        rows = store.read_samples(agent, 0).to_pylist()
        samples = [Sample(r["prompt_ids"], r["response_ids"], r["logprobs"], r["advantage"], r["loss_mask"])
                   for r in rows]
        assert any(s.advantage > 0 for s in samples) and any(s.advantage < 0 for s in samples), agent
        scorer = trainer(tiny_model())
        per_version = []
        for version in (0, 1):
            scorer.set_weights(load_weights(run_dir, agent, version), version)
            per_version.append(scorer.logprobs(samples))
        before, after = per_version
        # The weights that sampled them score them as the rollout did (on-policy, fp32).
        for s, lp in zip(samples, before, strict=True):
            assert torch.allclose(torch.tensor(lp), torch.tensor(s.logprobs), atol=1e-4), agent
        # sum_s A_s * sum_t (logp_after - logp_before): the surrogate the step ascended. Adam's
        # first step moves every weight by lr = 1e-4 along its gradient's sign, so the first-order
        # gain is lr * |g|_1 > 0 and the second-order term is ~lr^2: it cannot flip the sign.
        gain = sum(s.advantage * sum(a - b for a, b in zip(la, lb, strict=True))
                   for s, la, lb in zip(samples, after, before, strict=True))
        assert gain > 0, (agent, gain)
        moved = sum(abs(a - b) for la, lb in zip(after, before, strict=True) for a, b in zip(la, lb, strict=True))
        assert moved > 0, agent
