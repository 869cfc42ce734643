"""RL algorithms as pure tensor functions: advantage estimators and policy losses, by name."""

from flexmarl_core.algorithms.advantages import (
    ADVANTAGES,
    GroupStats,
    Scope,
    advantage_scope,
    compute_advantages,
    get_advantage,
    group_index_of,
    group_stats,
    register_advantage,
)
from flexmarl_core.algorithms.gae import explained_variance, gae_chain, gae_tokens, value_loss
from flexmarl_core.algorithms.losses import (
    POLICY_LOSSES,
    get_policy_loss,
    kl_k3,
    make_loss_fn,
    register_policy_loss,
    token_weight,
)
from flexmarl_core.algorithms.registry import Registry

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "GroupStats",
    "Registry",
    "Scope",
    "advantage_scope",
    "compute_advantages",
    "explained_variance",
    "gae_chain",
    "gae_tokens",
    "get_advantage",
    "get_policy_loss",
    "group_index_of",
    "group_stats",
    "kl_k3",
    "make_loss_fn",
    "register_advantage",
    "register_policy_loss",
    "token_weight",
    "value_loss",
]
