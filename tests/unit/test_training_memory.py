"""Training memory: chunked forward/backward under a token budget gives the unchunked gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from flexmarl_core.config import AgentConfig, ConfigError, config_from_dict
from flexmarl_core.models import get_tokenizer  # noqa: F401  (tokenizer cache via helpers)
from flexmarl_core.models.factory import preset_config
from flexmarl_core.training import global_loss_scale, make_trainer
from flexmarl_core.training.memory import bytes_per_token, chunk_rows, default_chunk_tokens
from tests._models_util import random_samples, tiny_model, tokenizer, trainer


def _grads(t) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters()}


def test_chunk_rows_respects_the_budget_and_keeps_every_row_once():
    lengths = [5, 40, 7, 7, 100, 3, 22, 9]
    assert chunk_rows(lengths, None) == [list(range(8))]
    assert chunk_rows(lengths, 8 * 100) == [list(range(8))]  # fits: one chunk, original order
    for budget in (1, 30, 64, 150, 799):
        chunks = chunk_rows(lengths, budget)
        assert sorted(i for c in chunks for i in c) == list(range(8))
        for c in chunks:
            padded = len(c) * max(lengths[i] for i in c)
            # Only a single row longer than the budget may exceed it.
            assert padded <= budget or len(c) == 1, (budget, c)
    # Longest first: the 100-token row never pads the short ones.
    assert chunk_rows(lengths, 150)[0] == [4]


@pytest.mark.parametrize("temperature,ckpt", [(1.0, False), (0.7, False), (0.7, True)])
def test_chunked_gradient_equals_unchunked(temperature, ckpt):
    samples = random_samples(12, seed=3)
    base = tiny_model(0)
    whole = trainer(copy.deepcopy(base), temperature=temperature, chunk_tokens=10**9)
    chunked = trainer(copy.deepcopy(base), temperature=temperature, chunk_tokens=48,
                      activation_checkpointing=ckpt)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    assert len(chunk_rows(lengths, 48)) >= 4  # really split
    scale = global_loss_scale([samples], whole.loss_weight)
    m_whole = whole.accumulate(samples, scale)
    m_chunk = chunked.accumulate(samples, scale)
    # Chunking only regroups float32 sums (each gradient element is one term per token): two
    # orders of T terms differ by up to ~T * eps * the largest term, bounded here by the
    # tensor's largest element, as in test_training's micro-batch test. A lost chunk or a
    # double-counted one is off by a sizeable fraction of max|g|.
    tokens = sum(lengths)
    eps = torch.finfo(torch.float32).eps
    for name, g in _grads(whole).items():
        atol = tokens * eps * float(g.abs().max())
        torch.testing.assert_close(_grads(chunked)[name], g, rtol=0, atol=atol, msg=name)
    assert m_whole.keys() == m_chunk.keys()
    for k, v in m_whole.items():
        if k not in ("tokens_padded", "tokens_cells", "tokens_shared"):  # counts of the layout, which chunking changes
            assert m_chunk[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k

    def computed(m: dict) -> float:  # the samples' tokens, each computed or shared once
        return m["tokens_cells"] - m["tokens_padded"] + m["tokens_shared"]

    assert computed(m_chunk) == computed(m_whole) == m_whole["tokens_sample"]
    assert whole.step().grad_norm == pytest.approx(chunked.step().grad_norm, rel=1e-5)


def test_default_budget_follows_memory_and_model_size():
    tok = tokenizer()
    small, big = preset_config("tiny-1m", tok), preset_config("tiny-10m", tok)
    gib = 1 << 30
    # Twice the memory, twice the tokens; the bigger model gets fewer tokens per byte.
    assert default_chunk_tokens(big, memory_limit=12 * gib) == pytest.approx(
        2 * default_chunk_tokens(big, memory_limit=6 * gib), rel=1e-3)
    assert default_chunk_tokens(big, memory_limit=6 * gib) < default_chunk_tokens(small, memory_limit=6 * gib)
    # The measured cost (module docstring): tiny-10m ~306 KiB/token, tiny-1m ~80 KiB/token.
    assert 250 * 1024 < bytes_per_token(big) < 360 * 1024
    assert 60 * 1024 < bytes_per_token(small) < 100 * 1024
    assert bytes_per_token(big, activation_checkpointing=True) < bytes_per_token(big)
    # The 256-sequence micro-batch of the issue (~110 tokens each) no longer fits in one chunk
    # of a 6 GiB worker.
    assert default_chunk_tokens(big, memory_limit=6 * gib) < 256 * 110


def test_make_trainer_takes_the_budget_from_the_config_and_checks_the_backend():
    agent = AgentConfig(name="a", template="{input}", backend={"train_chunk_tokens": 64})
    tr = make_trainer(agent, tiny_model(0))
    assert tr.chunk_tokens == 64
    tr = make_trainer(AgentConfig(name="a", template="{input}"), tiny_model(0))
    assert tr.chunk_tokens == default_chunk_tokens(tr.model.config)
    team = {"agents": [{"name": "a", "template": "{input}",
                        "backend": {"training": "torch", "activation_checkpointing": True}}]}
    config_from_dict({"team": team})
    team["agents"][0]["algorithm"] = {"skip_zero_advantage": True, "kl_coef": 0.1}
    with pytest.raises(ConfigError, match="skip_zero_advantage needs kl_coef=0"):
        config_from_dict({"team": team})


def test_skipping_zero_advantage_samples_leaves_the_gradient_unchanged():
    from flexmarl_core.trainers.policy import skip_zero_advantage

    samples = random_samples(8, seed=5)
    for s in samples[::2]:
        s.advantage = 0.0  # a group with all-equal rewards
    trained, skipped = skip_zero_advantage(samples)
    assert len(trained) == 4 and len(skipped) == 4 and all(s.advantage == 0.0 for s in skipped)
    base = tiny_model(0)
    full, lean = trainer(copy.deepcopy(base)), trainer(copy.deepcopy(base))
    scale = global_loss_scale([samples], full.loss_weight)  # the same constant for both
    full.accumulate(samples, scale)
    lean.accumulate(trained, scale)
    # A zero-advantage token's loss is -0 * ratio: its gradient is exactly 0, so only the
    # batch layout (padding width) differs; float32 regrouping bound as above.
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    eps = torch.finfo(torch.float32).eps
    for name, g in _grads(full).items():
        atol = tokens * eps * float(g.abs().max())
        torch.testing.assert_close(_grads(lean)[name], g, rtol=0, atol=atol, msg=name)
    # All zero: one sample is kept so the micro-batch still counts, and its gradient is 0.
    for s in samples:
        s.advantage = 0.0
    trained, skipped = skip_zero_advantage(samples)
    assert len(trained) == 1 and len(skipped) == 7
    zero = trainer(copy.deepcopy(base))
    zero.accumulate(trained, scale)
    assert all(float(g.abs().max()) == 0.0 for g in _grads(zero).values())
