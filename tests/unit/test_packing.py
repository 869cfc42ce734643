"""Packed training batches (`TrainerOptions.packing`): several samples per row, each attending
only to itself, give the padded path's log-probs, loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from flexmarl_core.config import AlgorithmConfig
from flexmarl_core.training import collate
from flexmarl_core.training.collate import pack_rows
from tests._models_util import assert_trains_alike, random_samples, tiny_model, trainer


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
    out_padded, out_packed = assert_trains_alike(padded, packed, samples)
    assert out_packed["tokens_cells"] < out_padded["tokens_cells"]
