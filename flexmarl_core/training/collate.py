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


def pack_rows(lengths: Sequence[int]) -> list[list[int]]:
    """Samples placed into rows no longer than the longest sample, first fit, longest first:
    the padded width stays what it was and the rows shrink. Deterministic for given lengths;
    where no two samples fit in one row, exactly the padded layout."""
    width = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for k, left in enumerate(room):
            if lengths[i] <= left:
                rows[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    if len(rows) == len(lengths):  # nothing shares a row: the padded layout, in its own order
        return [[i] for i in range(len(lengths))]
    return rows


def collate(micro_batch: MicroBatch, pad_id: int = 0, *, pack: bool = False) -> TokenBatch:
    """Right-pad a micro-batch into a `TokenBatch` (CPU tensors); `pack`: several samples per
    row (`pack_rows`), each sample's positions restarting at 0 so that the model's attention
    stays within it (transformers reads packed rows from `position_ids`)."""
    if not micro_batch:
        raise ValueError("empty micro-batch")
    for i, s in enumerate(micro_batch):
        _check(i, s)
    bsz = len(micro_batch)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in micro_batch]
    t_max = max(lengths)
    r_max = max(len(s.response_ids) for s in micro_batch)
    layout = pack_rows(lengths) if pack else [[b] for b in range(bsz)]
    pack = len(layout) < bsz  # nothing shares a row: exactly the padded batch
    where = {b: (row, sum(lengths[c] for c in layout[row][:k])) for row, members in enumerate(layout)
             for k, b in enumerate(members)}  # sample -> (row, offset in it)
    n_rows = len(layout)
    input_ids = torch.full((n_rows, t_max), pad_id, dtype=torch.long)
    attn = torch.zeros((n_rows, t_max), dtype=torch.long)
    positions = torch.arange(t_max).repeat(n_rows, 1) if pack else None
    target_index = torch.zeros((bsz, r_max), dtype=torch.long)
    response_ids = torch.zeros((bsz, r_max), dtype=torch.long)
    mask = torch.zeros((bsz, r_max), dtype=torch.float32)
    old = torch.zeros((bsz, r_max), dtype=torch.float32)
    for b, s in enumerate(micro_batch):
        p, r = len(s.prompt_ids), len(s.response_ids)
        row, at = where[b]
        input_ids[row, at: at + p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attn[row, at: at + p + r] = 1
        if positions is not None:
            positions[row, at: at + p + r] = torch.arange(p + r)
        target_index[b, :r] = torch.arange(at + p - 1, at + p - 1 + r)
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
        rows=torch.tensor([where[b][0] for b in range(bsz)], dtype=torch.long) if pack else None,
        position_ids=positions,
        padded_tokens=n_rows * t_max - sum(lengths),
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
