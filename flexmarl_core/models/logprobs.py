"""Token log-probabilities, defined once for the rollout engine and the trainer.

Definition (both sides use this function, so the PPO ratio is exactly 1 on-policy):

    logprob(token) = log_softmax(logits / T)[token],   T = temperature if temperature > 0 else 1

i.e. the log-probability under the *temperature-scaled* distribution the token was sampled from
(like verl), without the top-p truncation (top-p only removes the tail the sampler never draws;
scoring it too would make every token outside the nucleus -inf for the trainer). Greedy decoding
(temperature 0) is scored at T = 1. Computed in fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch


def scoring_temperature(temperature: float) -> float:
    """The T used to score tokens sampled at `temperature` (0 = greedy is scored at 1)."""
    return float(temperature) if temperature > 0 else 1.0


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, inplace: bool = False
) -> torch.Tensor:
    """log p(targets) under softmax(logits / T).

    Args:
        logits: (..., V) raw model logits, any float dtype.
        targets: (...) token ids (long).
        temperature: the sampling temperature (see `scoring_temperature`).
        inplace: the caller no longer needs `logits` (e.g. a model output that no backward
            saves): the temperature is applied in place, so no second (..., V) copy is made.
    Returns:
        (...) fp32 log-probabilities. Uses gather - logsumexp rather than a full log_softmax so
        no (..., V) output tensor is kept for backward.
    """
    scaled = logits.float()
    t = scoring_temperature(temperature)
    if t != 1.0:
        scaled = scaled.div_(t) if inplace else scaled / t
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)
