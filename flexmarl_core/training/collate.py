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


def collate(micro_batch: MicroBatch, pad_id: int = 0, *, pack: bool = False,
            share_prefix: bool = False) -> TokenBatch:
    """Right-pad a micro-batch into a `TokenBatch` (CPU tensors); `pack`: several samples per
    row (`pack_rows`), each sample's positions restarting at 0 so that the model's attention
    stays within it (transformers reads packed rows from `position_ids`); `share_prefix`:
    samples with one prompt (a GRPO group) share one copy of it (`collate_shared`)."""
    if not micro_batch:
        raise ValueError("empty micro-batch")
    for i, s in enumerate(micro_batch):
        _check(i, s)
    if share_prefix:
        units = _units(micro_batch)
        if len(units) < len(micro_batch):  # a unit holds a group: some prompt is shared
            return collate_shared(micro_batch, units, pad_id, pack=pack)
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
    for b, s in enumerate(micro_batch):
        p, r = len(s.prompt_ids), len(s.response_ids)
        row, at = where[b]
        input_ids[row, at: at + p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attn[row, at: at + p + r] = 1
        if positions is not None:
            positions[row, at: at + p + r] = torch.arange(p + r)
        target_index[b, :r] = torch.arange(at + p - 1, at + p - 1 + r)
    response_ids, mask, old, advantages = _per_sample(micro_batch, r_max)
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


#: a unit of a collated batch: (token ids, positions, segment per token, {sample: the index of
#: the position that predicts its first response token})
Unit = tuple[list[int], list[int], list[int], dict[int, int]]


def _units(micro_batch: MicroBatch) -> list[Unit]:
    """The batch as `Unit`s of tokens, in the order of each prompt's first sample. A group of samples with one
    prompt P is one unit: P[:-1] once (segment 0, seen by all), then per sample its own copy
    of P's last token followed by its response (a segment of its own, positions going on
    from len(P) - 1). The copy makes the position before each response that response's own,
    so every sample is scored as in a row of its own. Any other sample is a unit alone."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for b, s in enumerate(micro_batch):
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(b)
    units = []
    for prompt, members in by_prompt.items():
        p = len(prompt)
        if len(members) > 1 and p > 1:
            ids, pos, seg, first = list(prompt[:-1]), list(range(p - 1)), [0] * (p - 1), {}
            for k, b in enumerate(members, start=1):
                resp = micro_batch[b].response_ids
                first[b] = len(ids)
                ids += [prompt[-1], *resp]
                pos += range(p - 1, p + len(resp))
                seg += [k] * (1 + len(resp))
            units.append((ids, pos, seg, first))
        else:
            for b in members:
                resp = micro_batch[b].response_ids
                units.append(([*prompt, *resp], list(range(p + len(resp))), [1] * (p + len(resp)), {b: p - 1}))
    return units


def collate_shared(micro_batch: MicroBatch, units: list[Unit], pad_id: int = 0, *,
                   pack: bool = False) -> TokenBatch:
    """`collate` where samples with one prompt share it (Prefix Grouper's layout): the prompt
    is encoded once per group and each response attends to it and to itself only, through an
    explicit (N, 1, T, T) mask (`TokenBatch.attend`). A group of G samples with prompt P and
    responses r_i costs P - 1 + sum(1 + r_i) token cells instead of sum(P + r_i); log-probs,
    loss and gradients are the padded path's (tests/unit/test_shared_prefix.py). `units`: the
    batch's (`_units`); `pack`: units go several to a row as in `pack_rows`."""
    bsz = len(micro_batch)
    lengths = [len(u[0]) for u in units]
    layout = pack_rows(lengths) if pack else [[u] for u in range(len(units))]
    n_rows, t_max = len(layout), max(sum(lengths[u] for u in row) for row in layout)
    r_max = max(len(s.response_ids) for s in micro_batch)
    input_ids = torch.full((n_rows, t_max), pad_id, dtype=torch.long)
    positions = torch.zeros((n_rows, t_max), dtype=torch.long)
    unit_of = torch.full((n_rows, t_max), -1, dtype=torch.long)  # -1: padding
    seg_of = torch.zeros((n_rows, t_max), dtype=torch.long)
    rows = torch.zeros(bsz, dtype=torch.long)
    target_index = torch.zeros((bsz, r_max), dtype=torch.long)
    for row, members in enumerate(layout):
        at = 0
        for u in members:
            ids, pos, seg, first = units[u]
            n = len(ids)
            input_ids[row, at: at + n] = torch.tensor(ids, dtype=torch.long)
            positions[row, at: at + n] = torch.tensor(pos, dtype=torch.long)
            unit_of[row, at: at + n] = u
            seg_of[row, at: at + n] = torch.tensor(seg, dtype=torch.long)
            for b, f in first.items():
                rows[b] = row
                r = len(micro_batch[b].response_ids)
                target_index[b, :r] = torch.arange(at + f, at + f + r)
            at += n
    # Query q sees key k when k is not after q, both are in one unit, and k is the unit's
    # shared prompt or in q's own segment. Padding sees itself alone: a query that sees nothing
    # would put NaN into the softmax and from there into the gradients.
    causal = torch.ones((t_max, t_max), dtype=torch.bool).tril_()
    same_unit = (unit_of[:, :, None] == unit_of[:, None, :]) & (unit_of[:, :, None] >= 0)
    visible = (seg_of[:, None, :] == 0) | (seg_of[:, :, None] == seg_of[:, None, :])
    attend = (same_unit & visible & causal) | torch.eye(t_max, dtype=torch.bool)
    response_ids, mask, old, advantages = _per_sample(micro_batch, r_max)
    cells = sum(lengths)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=(unit_of >= 0).long(),
        target_index=target_index,
        response_ids=response_ids,
        mask=mask,
        old_logprobs=old,
        advantages=advantages,
        rows=rows,
        position_ids=positions,
        padded_tokens=n_rows * t_max - cells,
        attend=attend[:, None],
        shared_tokens=sum(len(s.prompt_ids) + len(s.response_ids) for s in micro_batch) - cells,
    )


def _per_sample(micro_batch: MicroBatch,
                r_max: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every layout keeps per sample, whatever row it sits in: (B, R) response ids, loss
    mask and behaviour log-probs, right padded, and the advantages: (B,) per sequence, or (B, R)
    when any sample has token advantages (GAE)."""
    bsz = len(micro_batch)
    response_ids = torch.zeros((bsz, r_max), dtype=torch.long)
    mask = torch.zeros((bsz, r_max), dtype=torch.float32)
    old = torch.zeros((bsz, r_max), dtype=torch.float32)
    for b, s in enumerate(micro_batch):
        r = len(s.response_ids)
        response_ids[b, :r] = torch.tensor(s.response_ids, dtype=torch.long)
        mask[b, :r] = torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * r, dtype=torch.float32)
        old[b, :r] = torch.tensor(s.logprobs, dtype=torch.float32)
    advantages = torch.tensor([float(s.advantage) for s in micro_batch], dtype=torch.float32)
    if any(s.token_advantages is not None for s in micro_batch):
        advantages = advantages[:, None].repeat(1, r_max)
        for b, s in enumerate(micro_batch):
            if s.token_advantages is not None:
                advantages[b, : len(s.token_advantages)] = torch.tensor(s.token_advantages, dtype=torch.float32)
    return response_ids, mask, old, advantages


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
