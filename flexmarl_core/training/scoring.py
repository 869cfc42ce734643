"""Scoring response tokens under a model, the one way every trainer backend does it: the
batch's layout (padded, packed, shared prompts) goes in, (B, R) log-probs come out."""

from __future__ import annotations

from typing import Any

import torch

from flexmarl_core.models.logprobs import token_logprobs
from flexmarl_core.training.api import TokenBatch

#: attention implementations that take an explicit (N, 1, T, T) mask from the caller as it is
EXPLICIT_MASK_ATTENTION = ("sdpa", "eager")


def attention_impl(model: torch.nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager")


def attention_mask_for(model: torch.nn.Module, attend: torch.Tensor) -> torch.Tensor:
    """`TokenBatch.attend` in the form `model`'s attention adds it: sdpa takes the bool mask,
    eager adds a float one (0 where seen, the dtype's minimum where not)."""
    impl = attention_impl(model)
    if impl == "sdpa":
        return attend
    if impl == "eager":
        return torch.zeros(attend.shape, device=attend.device).masked_fill_(~attend, torch.finfo(torch.float32).min)
    raise ValueError(f"attention implementation {impl!r} takes no explicit mask; shared prompts need one of "
                     f"{EXPLICIT_MASK_ATTENTION} (set backend.share_prefix: false)")


def response_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    *,
    device: torch.device,
    temperature: float,
    bf16: bool,
    keep_ok: bool,
) -> torch.Tensor:
    """(B, R) fp32 logprobs of the response tokens of `batch` under `model` (grad flows if
    enabled); shared by every trainer so they score tokens identically.

    `keep_ok`: the model's forward takes `logits_to_keep` (lm_head then runs only over the
    response span)."""
    dev = device
    input_ids = batch.input_ids.to(dev)
    # No attention mask: with RIGHT padding a causal mask already hides every pad from every
    # real token (pads come after it), and attention keeps its fast is_causal path. Logits at
    # pad positions are garbage but never gathered into a real (mask = 1) entry.
    # Logits are needed only on [lo, hi): from the earliest first-response-token predictor to
    # the last predictor. Every row has >= 1 response token, so column 0 of target_index
    # holds each row's first target position.
    lo = int(batch.target_index[:, 0].min())
    hi = int(batch.target_index.max()) + 1
    # No KV cache: nothing decodes after this forward, and transformers reads packed rows from
    # `position_ids` only when there is no cache.
    kwargs: dict[str, Any] = {"use_cache": False}
    if batch.position_ids is not None:  # packed rows: positions restart per sample, and so does attention
        kwargs["position_ids"] = batch.position_ids.to(dev)
    if batch.attend is not None:  # shared prompts: who sees whom is spelled out
        kwargs["attention_mask"] = attention_mask_for(model, batch.attend.to(dev))
    if keep_ok:  # lm_head runs only over the span
        kwargs["logits_to_keep"] = torch.arange(lo, hi, device=dev)
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=input_ids, **kwargs).logits  # (B, T' = hi - lo, V)
    if not keep_ok:
        logits = logits[:, lo:hi]
    # Score every position in the span against the next input token, then pick the response
    # positions: gathering (B, R, V) logit rows instead would cost a V-wide scatter in backward.
    next_tokens = input_ids[:, lo + 1 : hi + 1]  # (B, T')
    # Lean: one full-vocabulary tensor is kept for backward (the fp32, temperature-scaled
    # logits that logsumexp saves), not also the raw logits and a scaled copy.
    per_pos = token_logprobs(logits, next_tokens, temperature, inplace=True)  # (B, T')
    del logits
    index = (batch.target_index.to(dev) - lo).clamp_(min=0)  # padding entries were 0
    if batch.rows is not None:  # packed: each sample's row (rows hold several samples)
        per_pos = per_pos.index_select(0, batch.rows.to(dev))
    return per_pos.gather(1, index)  # (B, R)
