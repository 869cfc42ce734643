"""Shared prompts in training (`TrainerOptions.share_prefix`): the G samples of one input encode
their prompt once and each response sees it and itself only; log-probs, loss and gradients are
the padded path's."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from flexmarl_core.config import AlgorithmConfig
from flexmarl_core.training import Sample, collate
from flexmarl_core.training.scoring import attention_mask_for
from tests._models_util import assert_trains_alike, tiny_model, trainer


def grouped_samples(groups: int, g: int, singles: int, seed: int = 0) -> list[Sample]:
    """`groups` inputs of `g` samples each (one prompt, responses of their own) and `singles`
    samples alone, shuffled so that no group's samples are neighbours."""
    rng = random.Random(seed)

    def sample(prompt: list[int]) -> Sample:
        r = rng.randint(2, 10)
        return Sample(prompt_ids=prompt, response_ids=[rng.randrange(3, 1000) for _ in range(r)],
                      logprobs=[-rng.uniform(5.5, 8.0) for _ in range(r)], advantage=rng.uniform(-1, 1),
                      loss_mask=[int(rng.random() > 0.2) for _ in range(r)])

    out = []
    for _ in range(groups):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(3, 14))]
        out += [sample(prompt) for _ in range(g)]
    out += [sample([rng.randrange(3, 1000) for _ in range(rng.randint(3, 14))]) for _ in range(singles)]
    rng.shuffle(out)
    return out


def test_a_group_holds_its_prompt_once_and_each_response_after_its_own_last_prompt_token():
    samples = grouped_samples(groups=3, g=4, singles=2, seed=1)
    batch = collate(samples, share_prefix=True)
    assert batch.attend is not None and batch.input_ids.shape[0] == 3 + 2  # a row per group, one per single
    # Each grouped sample saves its prompt but the last token (the copy that predicts its response).
    prompts: dict[tuple, int] = {}
    for s in samples:
        prompts[tuple(s.prompt_ids)] = prompts.get(tuple(s.prompt_ids), 0) + 1
    assert batch.shared_tokens == sum((n - 1) * (len(p) - 1) for p, n in prompts.items())
    for b, s in enumerate(samples):
        row, r, p = int(batch.rows[b]), len(s.response_ids), len(s.prompt_ids)
        at = int(batch.target_index[b, 0])  # the position that predicts the first response token
        assert batch.input_ids[row, at: at + 1 + r].tolist() == [s.prompt_ids[-1], *s.response_ids]
        assert batch.position_ids[row, at: at + 1 + r].tolist() == list(range(p - 1, p + r))
        assert batch.target_index[b, :r].tolist() == list(range(at, at + r))
        seen = batch.attend[row, 0, at + r].nonzero().flatten().tolist()  # what its last token sees
        # its whole prompt (shared part, then its own copy of the last token) and its response
        assert batch.input_ids[row, seen].tolist() == s.prompt_ids + s.response_ids
        assert batch.position_ids[row, seen].tolist() == list(range(p + r))


def test_without_a_shared_prompt_the_layout_is_unchanged():
    samples = grouped_samples(groups=0, g=0, singles=6, seed=2)
    a, b = collate(samples), collate(samples, share_prefix=True)
    assert b.attend is None and b.shared_tokens == 0 and torch.equal(a.input_ids, b.input_ids)


@pytest.mark.parametrize(("algo", "pack", "attn"), [
    (AlgorithmConfig(lr=1e-3), False, "sdpa"),
    (AlgorithmConfig(lr=1e-3), True, "sdpa"),
    (AlgorithmConfig(lr=1e-3, kl_coef=0.05), False, "sdpa"),
    (AlgorithmConfig(lr=1e-3), False, "eager"),
], ids=["grpo", "packed-too", "with-reference", "eager-attention"])
def test_shared_and_padded_give_the_same_logprobs_loss_and_gradients(algo, pack, attn):
    samples = grouped_samples(groups=3, g=4, singles=3, seed=4)
    base = tiny_model(0)
    base.set_attn_implementation(attn)
    ref = copy.deepcopy(base) if algo.kl_coef else None
    kw = {"ref_model": copy.deepcopy(ref)} if ref is not None else {}
    padded = trainer(copy.deepcopy(base), algo=algo, **kw)
    shared = trainer(copy.deepcopy(base), algo=algo, share_prefix=True, packing=pack, **kw)
    assert shared.share_prefix and not padded.share_prefix
    # attention over another number of masked keys; a shared prompt token's gradient is the
    # sum over its group's responses in one place instead of G
    out_padded, out_shared = assert_trains_alike(padded, shared, samples)
    assert out_shared["tokens_shared"] > 0 and out_padded["tokens_shared"] == 0
    assert out_shared["tokens_cells"] - out_shared["tokens_padded"] + out_shared["tokens_shared"] == \
        out_padded["tokens_cells"] - out_padded["tokens_padded"]  # every sample token, computed or shared


def test_an_attention_that_takes_no_mask_keeps_the_padded_layout():
    model = tiny_model(0)
    model.config._attn_implementation = "flex_attention"  # takes a BlockMask, not this mask
    assert not trainer(model, share_prefix=True).share_prefix
    with pytest.raises(ValueError, match="share_prefix: false"):
        attention_mask_for(model, torch.ones((1, 1, 2, 2), dtype=torch.bool))
