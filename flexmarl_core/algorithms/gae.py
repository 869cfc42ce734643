"""GAE over a team's calls: the estimator of `algorithm.advantage: gae` (PPO with a critic).

A trajectory of a team is one episode whose steps are the calls of its trainable agents in
call order (a YAML team's graph order, round after round: MARFT's sequential view of the team,
arXiv:2504.16129). Call i has the reward r_i its sample got (`workload.credit` decides what that
is) and the critic's value V_i of its observation (the prompt: the task plus its predecessors'
outputs). With V_N = 0 (the episode ends after the last call):

    delta_i = r_i + gamma * V_{i+1} - V_i
    A_i     = delta_i + gamma * lam * A_{i+1}          (A_N = 0)
    R_i     = A_i + V_i                                 (the critic's regression target)

(Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", arXiv:1506.02438.) The last agent of a round bootstraps from the first agent of
the next round, as MARFT's APPO chains agents, because the rounds are consecutive steps of the
one chain. Per token (MARFT's TPPO), the steps are the response tokens of every call in order,
the reward of a call arriving at its last token: `gae_tokens`.

The critic's loss is PPO's clipped value loss (`value_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexmarl_core.algorithms.advantages import register_advantage


def gae_chain(rewards: Sequence[float], values: Sequence[float], *, gamma: float,
              lam: float) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one chain of steps in order (module docstring), in float64."""
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} rewards but {len(values)} values")
    n = len(rewards)
    adv = [0.0] * n
    nxt_v, nxt_a = 0.0, 0.0
    for i in range(n - 1, -1, -1):
        delta = float(rewards[i]) + gamma * nxt_v - float(values[i])
        nxt_a = adv[i] = delta + gamma * lam * nxt_a
        nxt_v = float(values[i])
    return adv, [a + float(v) for a, v in zip(adv, values, strict=True)]


def gae_tokens(rewards: Sequence[float], token_values: Sequence[Sequence[float]], *, gamma: float,
               lam: float) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token GAE of one chain of calls: call i's tokens are steps with reward 0 but the
    last, which gets r_i; the last token of a call bootstraps from the next call's first.
    Returns per call its tokens' advantages and returns."""
    flat_r: list[float] = []
    flat_v: list[float] = []
    for r, vs in zip(rewards, token_values, strict=True):
        if not vs:
            raise ValueError("a call with no response token has no token to value")
        flat_r += [0.0] * (len(vs) - 1) + [float(r)]
        flat_v += [float(v) for v in vs]
    adv, ret = gae_chain(flat_r, flat_v, gamma=gamma, lam=lam)
    out_a, out_r, k = [], [], 0
    for vs in token_values:
        out_a.append(adv[k:k + len(vs)])
        out_r.append(ret[k:k + len(vs)])
        k += len(vs)
    return out_a, out_r


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
               clip: float | None) -> torch.Tensor:
    """PPO's clipped value loss per element (a SUM is the caller's): 0.5 * max((V - R)^2,
    (V_old + clamp(V - V_old, -clip, clip) - R)^2); `clip` None: 0.5 * (V - R)^2.
    V_old is the critic's value when the advantages were computed."""
    plain = (values - returns).pow(2)
    if clip is None:
        return 0.5 * plain
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(plain, (clipped - returns).pow(2))


def explained_variance(values: Sequence[float], returns: Sequence[float]) -> float:
    """1 - Var(R - V) / Var(R): 1 a perfect critic, 0 no better than a constant, < 0 worse;
    NaN when the returns do not vary."""
    v = torch.tensor(values, dtype=torch.float64)
    r = torch.tensor(returns, dtype=torch.float64)
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var() / r.var())


@register_advantage("gae", scope="critic")
def _gae_needs_values(rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """GAE with a critic (module docstring): the pipeline computes it from the critic's values
    along each trajectory's calls (`flexmarl_core/config/critic.py`), not from a group of rewards."""
    raise ValueError("algorithm.advantage 'gae' needs the critic's values along each trajectory: "
                     "use flexmarl_core.algorithms.gae.gae_chain (a run computes it in its train ops)")
