"""Micro-batch -> padded tensors, and the global-batch loss scale."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexmarl_core.training.api import LossWeightFn, MicroBatch, Sample, TokenBatch


def _check(i: int, s: Sample) -> None:
    if not s.prompt_ids:
        raise ValueError(f"sample {i}: empty prompt_ids (need at least one prompt token)")
    if not s.response_ids:
        raise ValueError(f"sample {i}: empty response_ids (nothing to train on)")
    if len(s.logprobs) != len(s.response_ids):
        raise ValueError(
            f"sample {i}: {len(s.logprobs)} logprobs for {len(s.response_ids)} response tokens; "
            "store one behaviour logprob per response token"
        )
    if s.token_advantages is not None and len(s.token_advantages) != len(s.response_ids):
        raise ValueError(f"sample {i}: {len(s.token_advantages)} token advantages for "
                         f"{len(s.response_ids)} response tokens")
    if s.loss_mask is not None and len(s.loss_mask) != len(s.response_ids):
        raise ValueError(
            f"sample {i}: loss_mask has {len(s.loss_mask)} entries for "
            f"{len(s.response_ids)} response tokens"
        )


def collate(micro_batch: MicroBatch, pad_id: int = 0) -> TokenBatch:
    """Right-pad a micro-batch into a `TokenBatch` (CPU tensors)."""
    if not micro_batch:
        raise ValueError("empty micro-batch")
    for i, s in enumerate(micro_batch):
        _check(i, s)
    bsz = len(micro_batch)
    t_max = max(len(s.prompt_ids) + len(s.response_ids) for s in micro_batch)
    r_max = max(len(s.response_ids) for s in micro_batch)
    input_ids = torch.full((bsz, t_max), pad_id, dtype=torch.long)
    attn = torch.zeros((bsz, t_max), dtype=torch.long)
    target_index = torch.zeros((bsz, r_max), dtype=torch.long)
    response_ids = torch.zeros((bsz, r_max), dtype=torch.long)
    mask = torch.zeros((bsz, r_max), dtype=torch.float32)
    old = torch.zeros((bsz, r_max), dtype=torch.float32)
    for b, s in enumerate(micro_batch):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[b, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attn[b, : p + r] = 1
        target_index[b, :r] = torch.arange(p - 1, p - 1 + r)
        response_ids[b, :r] = torch.tensor(s.response_ids, dtype=torch.long)
        mask[b, :r] = torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * r, dtype=torch.float32)
        old[b, :r] = torch.tensor(s.logprobs, dtype=torch.float32)
    advantages = torch.tensor([float(s.advantage) for s in micro_batch], dtype=torch.float32)
    if any(s.token_advantages is not None for s in micro_batch):  # GAE per token: (B, R)
        advantages = advantages[:, None].repeat(1, r_max)
        for b, s in enumerate(micro_batch):
            if s.token_advantages is not None:
                advantages[b, : len(s.token_advantages)] = torch.tensor(s.token_advantages, dtype=torch.float32)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attn,
        target_index=target_index,
        response_ids=response_ids,
        mask=mask,
        old_logprobs=old,
        advantages=advantages,
    )


def global_loss_scale(micro_batches: Sequence[MicroBatch], loss_weight_fn: LossWeightFn) -> float:
    """1 / (normalisation units of the whole global batch): the `loss_scale` for every
    `accumulate` of that batch. Raises if the batch has nothing to train on."""
    total = float(sum(loss_weight_fn(mb) for mb in micro_batches))
    if total <= 0:
        raise ValueError(
            f"global batch of {len(micro_batches)} micro-batches has loss weight {total}; "
            "nothing to train on (all loss masks zero?)"
        )
    return 1.0 / total
