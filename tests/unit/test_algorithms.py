"""Advantage estimators and the clipped policy loss against hand-computed values; registries."""

from __future__ import annotations

import math

import pytest
import torch

from flexmarl_core.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    advantage_scope,
    compute_advantages,
    get_advantage,
    get_policy_loss,
    group_stats,
    register_advantage,
    register_policy_loss,
)
from flexmarl_core.config import AlgorithmConfig

# Two groups of 3: (1, 0, 2) mean 1, unbiased std 1; (0, 0, 3) mean 1, std sqrt(3).
R = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
S3 = math.sqrt(3.0)
EPS = 1e-6


def close(a, b):
    # A few float ops (the group stats are float64, the result is cast to a's dtype) on values
    # of magnitude ~1-10: some ulps of a's dtype at the larger of 1 and the expected magnitude.
    want = torch.as_tensor(b, dtype=a.dtype)
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(a, want, atol=16 * torch.finfo(a.dtype).eps * scale, rtol=0)


def test_grpo_by_hand():
    close(compute_advantages("grpo", R), [[0, -1 / (1 + EPS), 1 / (1 + EPS)], [-1 / S3, -1 / S3, 2 / S3]])


def test_grpo_nostd_by_hand():
    close(compute_advantages("grpo_nostd", R), [[0, -1, 1], [-1, -1, 2]])


def test_rloo_by_hand():
    # r_i - mean of the other two
    close(compute_advantages("rloo", R), [[1 - 1, 0 - 1.5, 2 - 0.5], [0 - 1.5, 0 - 1.5, 3 - 0]])


def test_reinforce_pp_by_hand():
    a = [0.0, -1, 1, -1, -1, 2]  # r - group mean; mean(a) = 0
    std = math.sqrt(sum(x * x for x in a) / 5)
    close(compute_advantages("reinforce_pp", R).flatten(), [x / (std + EPS) for x in a])
    assert advantage_scope("reinforce_pp") == "batch" and advantage_scope("grpo") == "group"


def test_flat_with_labels_and_unequal_groups():
    rewards = torch.tensor([3.0, 1.0, 5.0, 2.0, 7.0])
    ids = ["p1", "p0", "p1", "p0", "solo"]  # p1: (3, 5); p0: (1, 2); solo: 7
    close(compute_advantages("grpo_nostd", rewards, ids), [-1, -0.5, 1, 0.5, 0])
    close(compute_advantages("rloo", rewards, ids), [-2, -1, 2, 1, 0])
    g = compute_advantages("grpo", rewards, ids)
    close(g, [-1 / (math.sqrt(2) + EPS), -0.5 / (math.sqrt(0.5) + EPS), 1 / (math.sqrt(2) + EPS), 0.5 / (math.sqrt(0.5) + EPS), 0])
    # the 2-D form and the flat form agree
    flat = compute_advantages("grpo", R.flatten(), [0, 0, 0, 1, 1, 1])
    close(flat, compute_advantages("grpo", R).flatten())
    s = group_stats(rewards, torch.tensor([0, 1, 0, 1, 2]))
    close(s.mean, [4, 1.5, 4, 1.5, 7])
    close(s.count, [2, 2, 2, 2, 1])


def test_shape_errors():
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", torch.ones(4))
    with pytest.raises(ValueError, match="group ids"):
        compute_advantages("grpo", torch.ones(4), [0, 0, 1])


def _hand_clipped(lp, old, adv, mask, eps, kl_coef, ref, norm):
    total = 0.0
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(lp[b][t] - old[b][t])
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            loss = max(-adv[b] * ratio, -adv[b] * clipped)
            d = ref[b][t] - lp[b][t]
            loss += kl_coef * (math.exp(d) - d - 1)
            total += loss
    return total / norm


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_clipped_loss_by_hand(kl_coef):
    lp = [[-1.0, -0.5, -2.0], [-0.1, -3.0, -1.0]]
    old = [[-1.3, -0.5, -1.5], [-0.2, -2.5, -9.0]]  # ratios 1.35, 1, 0.61 / 1.105, 0.61, -
    ref = [[-1.1, -0.7, -1.0], [-0.3, -3.0, -1.0]]
    adv = [0.8, -1.5]
    mask = [[1, 1, 1], [1, 1, 0]]
    cfg = AlgorithmConfig(clip_eps=0.2, kl_coef=kl_coef)
    loss, metrics = get_policy_loss("clipped")(
        torch.tensor(lp),
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask, dtype=torch.float32),
        cfg=cfg,
        ref_logprobs=torch.tensor(ref),
        normalizer=7.0,
    )
    close(loss, _hand_clipped(lp, old, adv, mask, 0.2, kl_coef, ref, 7.0))
    assert set(metrics) >= {"pg_loss", "clip_frac", "ratio"}
    assert ("kl" in metrics) == (kl_coef > 0)


def test_clipped_loss_requires_reference_when_kl():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_coef"):
        get_policy_loss("clipped")(x, x, torch.zeros(1), torch.ones(1, 2), cfg=AlgorithmConfig(kl_coef=0.1))


def test_registries_reject_unknown_and_duplicate_names():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'vtrace'.*gae, grpo, grpo_nostd, rae, reinforce_pp, rloo"):
        get_advantage("vtrace")
    with pytest.raises(ValueError, match="needs the critic's values"):  # registered, computed by the pipeline
        compute_advantages("gae", [1.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss.*clipped"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r, g, *, eps: r)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("clipped")(lambda *a, **k: None)
    assert {"grpo", "grpo_nostd", "rloo", "reinforce_pp"} <= set(ADVANTAGES.names())
    assert "clipped" in POLICY_LOSSES
