"""Policy losses, and the glue that turns one into the trainer's `loss_fn` / `loss_weight_fn`.

A policy loss is a pure tensor function registered by name:

    fn(logprobs, old_logprobs, advantages, mask, *, cfg, ref_logprobs=None, normalizer=1.0)
        -> (loss: scalar, metrics: dict[str, scalar tensor])

    logprobs, old_logprobs, mask, ref_logprobs: (B, R);  advantages: (B,) or (B, R)

Loss normalisation (fixed before any backward, so micro-batch accumulation is exact):

    loss = sum_{b,t} mask[b,t] * l[b,t] / normalizer

In the trainer path the function is called with normalizer=1 (a token SUM) and the trainer
multiplies by the caller's `loss_scale`, one constant for the whole global batch:

- RL (`stages/train.loss_scale`): 1 / (samples per global batch x max_new_tokens), known from
  the config before any rollout, so a micro-batch can train the moment its rewards are in.
  This is Dr. GRPO's constant normaliser, not GRPO's: GRPO divides each sequence's token sum
  by its own length and averages sequences, which weighs a token of a short answer more than
  one of a long answer; here every sampled token weighs the same.
- SFT (`flexmarl_core/driver/sft.py`): 1 / (loss tokens of the global batch), from `token_weight`,
  since the demonstrations are all known up front.

Metrics come back scaled the same way; the RL train stage reports them as per-token means.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from flexmarl_core.algorithms.registry import Registry

if TYPE_CHECKING:  # contracts only: the trainers import this module
    from flexmarl_core.config.agent import AlgorithmConfig
    from flexmarl_core.training.api import LossFn, MicroBatch, TokenBatch


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        cfg: AlgorithmConfig,
        ref_logprobs: torch.Tensor | None = None,
        normalizer: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "algorithm.policy_loss")


def register_policy_loss(name: str, *, off_policy: bool = False):
    """Decorator registering a policy loss under `name` (duplicate names raise). `off_policy`:
    it corrects for samples from older weights, so `codesign.max_staleness > 0` may use it."""
    return POLICY_LOSSES.register(name, off_policy=off_policy)


def get_policy_loss(name: str) -> PolicyLossFn:
    return POLICY_LOSSES.get(name)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) (Schulman 2020, "Approximating KL divergence"):
    k3 = exp(ref - logp) - (ref - logp) - 1  >= 0, unbiased, low variance."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


@register_policy_loss("clipped")
def clipped(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cfg: AlgorithmConfig,
    ref_logprobs: torch.Tensor | None = None,
    normalizer: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) + optional k3 KL.

    ratio = exp(logp - old_logp)
    l     = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)) + kl_coef * k3(logp, ref)
    loss  = sum(mask * l) / normalizer

    Shapes: logprobs/old_logprobs/mask/ref_logprobs (B, R); advantages (B,) or (B, R).
    Metrics (same normalisation): pg_loss, kl, clip_frac (tokens where the clip is active),
    ratio, entropy (-logp of the sampled tokens: on-policy, its mean estimates the policy's
    entropy per token without the full-vocabulary distribution).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    on = mask > 0
    # where() rather than multiply: padding positions must not turn inf * 0 into NaN.
    log_ratio = torch.where(on, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    pg = torch.maximum(pg1, pg2)
    per_token = pg
    metrics: dict[str, torch.Tensor] = {}
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(
                f"algorithm.kl_coef={cfg.kl_coef} needs reference logprobs; build the trainer "
                "with a reference model (make_trainer does when kl_coef > 0)"
            )
        kl = torch.where(on, kl_k3(logprobs, ref_logprobs), torch.zeros_like(logprobs))
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl"] = (kl * mask).sum().detach() / normalizer
    loss = (per_token * mask).sum() / normalizer
    metrics["pg_loss"] = (pg * mask).sum().detach() / normalizer
    metrics["clip_frac"] = ((pg2 > pg1).float() * mask).sum() / normalizer
    metrics["ratio"] = (ratio * mask).sum().detach() / normalizer
    nll = torch.where(on, -logprobs.detach(), torch.zeros_like(logprobs))
    metrics["entropy"] = (nll * mask).sum() / normalizer
    return loss, metrics


@register_policy_loss("decoupled_ppo", off_policy=True)
def decoupled_ppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cfg: AlgorithmConfig,
    ref_logprobs: torch.Tensor | None = None,
    normalizer: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO with a truncated behaviour weight, for stale samples (bounded staleness).

    Source: Hilton, Cobbe, Schulman, "Batch size-invariance for policy optimization" (2022,
    arXiv:2110.00641), the decoupled objective; used for asynchronous LLM RL by AReaL (Fu et
    al. 2025, arXiv:2505.24298, eq. 5). Three policies: the behaviour policy that sampled the
    tokens (its logprobs are stored with each sample: `old_logprobs` here), the proximal policy
    (the weights being updated, before the step: one optimizer step per iteration, so it is the
    current weights and its logprobs are `logprobs.detach()`), and the policy being optimised.

    w     = min(exp(logp_prox - logp_behav), is_cap)        (truncated importance weight)
    r     = exp(logp - logp_prox)                           (= 1 in value; its gradient flows)
    l     = w * max(-A * r, -A * clip(r, 1 - eps, 1 + eps)) + kl_coef * k3(logp, ref)
    loss  = sum(mask * l) / normalizer

    On-policy (behaviour = proximal) w is 1 and the gradient is the clipped loss's. Metrics as
    `clipped`, plus is_weight (mean w) and is_trunc_frac (tokens where the cap bit).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    on = mask > 0
    zero = torch.zeros_like(logprobs)
    prox = logprobs.detach()
    log_w = torch.where(on, prox - old_logprobs, zero)
    w_raw = torch.exp(log_w)
    w = w_raw.clamp(max=cfg.is_cap)
    ratio = torch.exp(torch.where(on, logprobs - prox, zero))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    pg = w * torch.maximum(pg1, pg2)
    per_token = pg
    metrics: dict[str, torch.Tensor] = {}
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"algorithm.kl_coef={cfg.kl_coef} needs reference logprobs")
        kl = torch.where(on, kl_k3(logprobs, ref_logprobs), zero)
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl"] = (kl * mask).sum().detach() / normalizer
    loss = (per_token * mask).sum() / normalizer
    metrics["pg_loss"] = (pg * mask).sum().detach() / normalizer
    metrics["clip_frac"] = ((pg2 > pg1).float() * mask).sum() / normalizer
    metrics["ratio"] = (ratio * mask).sum().detach() / normalizer
    metrics["is_weight"] = (w * mask).sum() / normalizer
    metrics["is_trunc_frac"] = ((w_raw > cfg.is_cap).float() * mask).sum() / normalizer
    metrics["entropy"] = (torch.where(on, -prox, zero) * mask).sum() / normalizer
    return loss, metrics


def make_loss_fn(cfg: AlgorithmConfig) -> LossFn:
    """The trainer `loss_fn` for `cfg.policy_loss`: a token SUM (normalizer 1); the caller's
    `loss_scale` turns it into a mean (module docstring: which constant RL and SFT use).

    A `functools.partial` of a module-level function, so it pickles: a data-parallel trainer
    sends it to its rank processes (which look the loss up again in their own registry)."""
    get_policy_loss(cfg.policy_loss)  # an unknown name fails here, listing the valid ones
    return functools.partial(_policy_token_sum, cfg=cfg)


def _policy_token_sum(
    logprobs: torch.Tensor, batch: TokenBatch, *, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    return get_policy_loss(cfg.policy_loss)(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.mask,
        cfg=cfg,
        ref_logprobs=batch.ref_logprobs,
        normalizer=1.0,
    )


def token_weight(micro_batch: MicroBatch) -> float:
    """Loss tokens in a micro-batch (the `loss_weight_fn` matching `make_loss_fn`)."""
    return float(
        sum(sum(s.loss_mask) if s.loss_mask is not None else len(s.response_ids) for s in micro_batch)
    )
