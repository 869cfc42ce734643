"""Advantage estimators: rewards of G samples per input -> one advantage per sample.

Every estimator is a pure tensor function registered by name:

    fn(rewards: (N,) float, group_index: (N,) long in [0, K), *, eps: float) -> (N,) float

`compute_advantages(name, rewards, group_ids)` accepts the friendlier shapes: rewards
(num_groups, G), or flat (N,) with group ids (a tensor, or any hashable labels such as input
ids) and returns the same shape as `rewards`. Group statistics come from one helper,
`group_stats`. Groups may have different sizes.

Scope: "group" estimators need only the sample's own group (a micro-batch of whole groups can
be trained the moment it has rewards); "batch" estimators (reinforce_pp) normalise over the
whole global batch, so the pipeline must wait for all of its rewards; "critic" estimators (gae,
`algorithms/gae.py`) need the critic's values of the micro-batch. `advantage_scope(name)`; what
each scope means for the plan and the train op is an object in `trainers/scopes.py`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from flexmarl_core.algorithms.registry import Registry

#: the name of an estimator scope (`trainers/scopes.py` `SCOPES`: group, batch, critic, or one
#: registered there)
Scope = str


class AdvantageFn(Protocol):
    def __call__(
        self, rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float
    ) -> torch.Tensor: ...


ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator", "algorithm.advantage")


def register_advantage(name: str, *, scope: Scope = "group"):
    """Decorator registering an estimator under `name` (duplicate names raise)."""
    return ADVANTAGES.register(name, scope=scope)


def get_advantage(name: str) -> AdvantageFn:
    return ADVANTAGES.get(name)


def advantage_scope(name: str) -> Scope:
    """The name of the estimator's scope: what it needs (module doc)."""
    return str(ADVANTAGES.info(name)["scope"])


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Per-sample view of its group's statistics; every field is (N,)."""

    mean: torch.Tensor  #: mean reward of the sample's group
    std: torch.Tensor  #: unbiased std of the group (n - 1 denominator); 0 for a group of one
    count: torch.Tensor  #: size of the group (float)


def group_stats(rewards: torch.Tensor, group_index: torch.Tensor) -> GroupStats:
    """Mean / unbiased std / size of each sample's group, by scatter-add (any group sizes).

    Args:
        rewards: (N,) float.
        group_index: (N,) long, values in [0, K).
    """
    r = rewards.to(torch.float64)  # float64 sums: exact-enough means for the 1e-6 tests
    k = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, group_index, r) / count.clamp(min=1)
    dev = r - mean[group_index]
    sq = torch.zeros(k, dtype=torch.float64).index_add_(0, group_index, dev * dev)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    dt = rewards.dtype if rewards.is_floating_point() else torch.float32
    return GroupStats(
        mean=mean[group_index].to(dt), std=std[group_index].to(dt), count=count[group_index].to(dt)
    )


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300):
    A_i = (r_i - mean_g) / (std_g + eps), std unbiased; a group of one gets 0."""
    s = group_stats(rewards, group_index)
    return (rewards - s.mean) / (s.std + eps)


@register_advantage("grpo_nostd")
def grpo_nostd(rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): A_i = r_i - mean_g (no std scaling)."""
    return rewards - group_stats(rewards, group_index).mean


@register_advantage("rae", scope="role")
def rae(rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Role-conditioned advantage estimation (SPIRAL): its scope hands it each return less its
    role's baseline (`trainers/scopes.py` `RoleScope`), which is the advantage."""
    return rewards.clone()


@register_advantage("rloo")
def rloo(rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): leave-one-out baseline
    A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_g); a group of one gets 0."""
    s = group_stats(rewards, group_index)
    return (rewards - s.mean) * s.count / (s.count - 1).clamp(min=1)


@register_advantage("reinforce_pp", scope="batch")
def reinforce_pp(rewards: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with group baseline (Hu et al. 2025, arXiv:2501.03262; OpenRLHF
    `reinforce_baseline`): a_i = r_i - mean_g, then normalised over the GLOBAL batch,
    A_i = (a_i - mean(a)) / (std(a) + eps), std unbiased over all N samples (N = 1 gives 0)."""
    a = rewards - group_stats(rewards, group_index).mean
    if a.numel() < 2:
        return torch.zeros_like(a)
    return (a - a.mean()) / (a.std() + eps)


def group_index_of(group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """Labels -> (N,) long indices in first-seen order (e.g. input ids -> 0, 1, ...)."""
    labels = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    seen: dict[Hashable, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in labels], dtype=torch.long)


def compute_advantages(
    name: str,
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable] | torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages from the estimator registered as `name`.

    Args:
        rewards: (num_groups, G), or (N,) together with `group_ids`.
        group_ids: (N,) group label per sample (tensor or hashables); required for flat rewards.
    Returns:
        Advantages with the shape of `rewards` (float32 unless rewards are float64).
    Call it on a whole global batch (or, for "group" scope, on whole groups).
    """
    fn = get_advantage(name)
    r = torch.as_tensor(rewards)
    r = r if r.is_floating_point() else r.to(torch.float32)
    if r.dim() == 2:
        if group_ids is not None:
            raise ValueError("pass either 2-D rewards (num_groups, G) or flat rewards + group_ids")
        k, g = r.shape
        idx = torch.arange(k).repeat_interleave(g)
        return fn(r.reshape(-1), idx, eps=eps).reshape(k, g)
    if r.dim() != 1:
        raise ValueError(f"rewards must be (num_groups, G) or (N,), got shape {tuple(r.shape)}")
    if group_ids is None:
        raise ValueError("flat rewards (N,) need group_ids (N,) saying which input each came from")
    idx = group_index_of(group_ids)
    if idx.numel() != r.numel():
        raise ValueError(f"{r.numel()} rewards but {idx.numel()} group ids")
    return fn(r, idx, eps=eps)
