"""Packed training batches (`TrainerOptions.packing`): several samples per row, each attending
only to itself, give the padded path's log-probs, loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from flexmarl_core.config import AlgorithmConfig
from flexmarl_core.training import collate, global_loss_scale
from flexmarl_core.training.collate import pack_rows
from tests._models_util import random_samples, tiny_model, trainer


def test_rows_hold_whole_samples_within_the_longest():
    lengths = [12, 3, 7, 9, 5, 12, 2, 4]
    rows = pack_rows(lengths)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # each sample once
    assert all(sum(lengths[i] for i in r) <= max(lengths) for r in rows)
    assert len(rows) < len(lengths) and pack_rows(lengths) == rows


def test_a_packed_batch_holds_each_sample_at_its_place():
    samples = random_samples(9, seed=3)
    padded, packed = collate(samples), collate(samples, pack=True)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0] and packed.padded_tokens < padded.padded_tokens
    for b, s in enumerate(samples):
        row, r = int(packed.rows[b]), len(s.response_ids)
        first = int(packed.target_index[b, 0]) + 1 - len(s.prompt_ids)  # where the sample starts in its row
        ids = packed.input_ids[row, first: first + len(s.prompt_ids) + r].tolist()
        assert ids == s.prompt_ids + s.response_ids
        assert packed.position_ids[row, first: first + len(ids)].tolist() == list(range(len(ids)))
        assert torch.equal(packed.response_ids[b], padded.response_ids[b])


@pytest.mark.parametrize("algo", [AlgorithmConfig(lr=1e-3), AlgorithmConfig(lr=1e-3, kl_coef=0.05)],
                         ids=["grpo", "with-reference"])
def test_packed_and_padded_give_the_same_logprobs_loss_and_gradients(algo):
    samples = random_samples(10, seed=4)
    base = tiny_model(0)
    ref = copy.deepcopy(base) if algo.kl_coef else None
    kw = {"ref_model": copy.deepcopy(ref)} if ref is not None else {}
    padded = trainer(copy.deepcopy(base), algo=algo, **kw)
    packed = trainer(copy.deepcopy(base), algo=algo, packing=True, **kw)
    lp_padded, lp_packed = padded.logprobs(samples), packed.logprobs(samples)
    # fp32 log-probs of about -7.5 (the untrained model over 1,024 tokens), computed in rows of
    # another shape: within 8 ulps at magnitude 8 (a sample attending to another is off by ~0.1)
    for a, b in zip(lp_padded, lp_packed, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=8 * torch.finfo(torch.float32).eps * 8)
    scale = global_loss_scale([samples], padded.loss_weight)
    out_padded, out_packed = padded.accumulate(samples, scale), packed.accumulate(samples, scale)
    assert out_packed["loss"] == pytest.approx(out_padded["loss"], rel=1e-5, abs=1e-7)
    assert out_packed["tokens_cells"] < out_padded["tokens_cells"]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    eps = torch.finfo(torch.float32).eps
    for (name, p), q in zip(padded.model.named_parameters(), packed.model.parameters(), strict=True):
        # the same terms summed in another order (see test_training's accumulation test)
        atol = tokens * eps * float(p.grad.abs().max())
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=atol, msg=name)
