"""Trainer: exact micro-batch accumulation, bit-exact state round trip, weights, handles."""

from __future__ import annotations

import copy

import pytest
import torch

from flexmarl_core.config import AgentConfig, AlgorithmConfig
from flexmarl_core.training import (
    Sample,
    TrainBackend,
    collate,
    drop,
    get,
    global_loss_scale,
    make_trainer,
    put,
)
from tests._models_util import assert_same_tensors, random_samples, tiny_model, trainer


def grads(t) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters()}


@pytest.mark.parametrize("split", [[2, 4], [1, 2, 3], [5, 1]])
def test_micro_batch_accumulation_equals_full_batch(split):
    samples = random_samples(6, seed=1)
    base = tiny_model(0)
    full, parts = trainer(copy.deepcopy(base)), trainer(copy.deepcopy(base))
    full.accumulate(samples, global_loss_scale([samples], full.loss_weight))
    mbs, i = [], 0
    for n in split:
        mbs.append(samples[i : i + n])
        i += n
    scale = global_loss_scale(mbs, parts.loss_weight)  # fixed before any backward
    for mb in reversed(mbs):  # order does not matter either
        parts.accumulate(mb, scale)
    # Splitting only reorders float32 sums: each gradient element sums one term per token of
    # the batch, and T terms summed in another order differ by up to ~T * eps * (their
    # magnitude), taken here as the tensor's largest element (near-cancelling elements, like
    # k_proj.bias whose exact gradient is 0, have no tighter scale of their own). A wrong loss
    # scale or a lost micro-batch is off by a fraction of max|g|, thousands of times more.
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    eps = torch.finfo(torch.float32).eps
    for name, g in grads(full).items():
        atol = tokens * eps * float(g.abs().max())
        torch.testing.assert_close(grads(parts)[name], g, rtol=0, atol=atol, msg=name)


def test_state_round_trip_is_bit_exact():
    samples = random_samples(4, seed=2)
    mbs = [samples[:2], samples[2:]]

    def train_step(t):
        scale = global_loss_scale(mbs, t.loss_weight)
        for mb in mbs:
            t.accumulate(mb, scale)
        return t.step()

    a = trainer(tiny_model(0))
    train_step(a)
    train_step(a)
    saved = a.state()
    train_step(a)
    b = trainer(tiny_model(7))  # different init: everything must come from the state
    b.load_state(saved)
    assert b.version == 2
    train_step(b)
    assert a.version == b.version == 3
    assert_same_tensors(a.weights(), b.weights())
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for k in sa["state"]:
        assert_same_tensors(sa["state"][k], sb["state"][k])
    # mid-accumulation state (pending grads) also round-trips, through a disk handle
    a.accumulate(mbs[0], 0.5)
    h = put(a.state(), "disk", cache_dir=_tmp_cache())
    c = trainer(tiny_model(9))
    c.load_state(get(h))
    drop(h)
    for t in (a, c):
        t.accumulate(mbs[1], 0.5)
        t.step()
    assert_same_tensors(a.weights(), c.weights())


def test_state_is_a_few_flat_tensors():
    """Weights, grads and Adam moments are one tensor each (a swap copies a handful of tensors,
    not hundreds); a state of another format or another model is refused."""
    t = trainer(tiny_model(0))
    t.accumulate(random_samples(3, seed=3), 0.1)
    t.step()
    t.accumulate(random_samples(2, seed=4), 0.1)  # pending grads travel too
    state = t.state()
    n_tensors = sum(isinstance(v, torch.Tensor) for v in [state["params"], state["grads"], state["rng"],
                                                         *state["adam"].values()])
    assert n_tensors == 6 and state["params"].numel() == sum(p.numel() for p in t.model.parameters())
    # Each parameter is a view of the flat buffer, so the optimizer's update is the model's.
    assert all(p.data_ptr() != 0 and p.grad is not None for p in t.model.parameters())
    with pytest.raises(ValueError, match="format 1"):
        trainer(tiny_model(5)).load_state({**state, "format": 1})
    with pytest.raises(ValueError, match="different model"):
        trainer(build_other_shape()).load_state(state)


def test_flat_buffers_survive_zero_grad_and_refuse_a_cast_model():
    """zero_grad() from either side keeps training working (grads zeroed, the flat buffer
    reattached); a model cast after the trainer was built fails loudly instead of silently
    not training."""
    t = trainer(tiny_model(0))
    t.accumulate(random_samples(3, seed=3), 0.1)
    t.optimizer.zero_grad()
    t.model.zero_grad()
    t.accumulate(random_samples(3, seed=4), 0.1)
    before = t._flat.detach().clone()
    r = t.step()
    assert r.grad_norm > 0 and not torch.equal(t._flat.detach(), before)
    # Only the second micro-batch's gradient counted: same as a fresh trainer on it alone.
    u = trainer(tiny_model(0))
    u.accumulate(random_samples(3, seed=3), 0.1)  # so both took the same RNG/metrics path
    u.model.zero_grad()
    u.accumulate(random_samples(3, seed=4), 0.1)
    # Same ops on the same data; a few float32 ulps of slack (the norm is returned as float32).
    assert u.step().grad_norm == pytest.approx(r.grad_norm, rel=8 * torch.finfo(torch.float32).eps)

    cast = trainer(tiny_model(0))
    cast.model.to(torch.bfloat16)
    cast.accumulate(random_samples(2, seed=5), 0.1)
    with pytest.raises(RuntimeError, match="no longer lives in the trainer's flat buffer"):
        cast.step()


def build_other_shape():
    from flexmarl_core.config import ModelConfig
    from flexmarl_core.models import build_model
    from tests._models_util import tokenizer

    return build_model(ModelConfig(preset="tiny-10m"), seed=0, tokenizer=tokenizer())


def _tmp_cache():
    from tests._models_util import cache_dir

    return cache_dir()


def test_handles_memory_disk_path_are_exact(tmp_path):
    t = trainer()
    t.accumulate(random_samples(2), 0.1)
    t.step()
    state = t.state()
    for where in ["memory", "disk", str(tmp_path / "s.pt"), f"file://{tmp_path}/u.pt"]:
        h = put(state, where, cache_dir=tmp_path)
        got = get(h)
        assert torch.equal(got["params"], state["params"]) and torch.equal(got["adam"]["exp_avg"], state["adam"]["exp_avg"])
        assert got["version"] == 1 and torch.equal(got["rng"], state["rng"])
        assert h.nbytes > 0
        drop(h)
        if where == "memory":
            with pytest.raises(ValueError, match="dropped"):
                get(h)


def _mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(8, 4, generator=g)
    base = torch.arange(10, dtype=torch.int64)
    return {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "half": torch.randn(7, generator=g).half(),
        "flags": torch.tensor([True, False, True]),
        "step": torch.tensor(3.0),  # 0-dim, like Adam's step counter
        "empty": torch.zeros(0, 5),
        "transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous
        "tied": [emb, emb],  # one tensor object twice, like tied embeddings
        "views": (base, base[2:7]),  # two tensors on one storage
        "rng": torch.get_rng_state(),
        "meta": {0: {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw", "none": None}},
        "version": 7,
    }


def _assert_same_state(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same_state(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want)
        for x, y in zip(got, want, strict=True):
            _assert_same_state(x, y)
    else:
        assert type(got) is type(want) and got == want


@pytest.mark.parametrize("where", ["memory", "disk", "path", "file"])
def test_handles_round_trip_mixed_state_bit_exact(tmp_path, where):
    state = _mixed_state()
    target = {"path": str(tmp_path / "s.state"), "file": f"file://{tmp_path}/f.state"}.get(where, where)
    h = put(state, target, cache_dir=tmp_path)
    assert h.nbytes == sum(
        t.nbytes for k, t in state.items() if isinstance(t, torch.Tensor)
    ) + state["tied"][0].nbytes + sum(t.nbytes for t in state["views"])
    got = get(h)
    _assert_same_state(got, state)
    assert got["tied"][0] is got["tied"][1]  # still tied
    torch.set_rng_state(got["rng"])  # a pooled-buffer tensor is a valid RNG state
    # A second get is independent of the first and of the handle.
    again = get(h)
    again["bf16"].zero_()
    assert torch.equal(got["bf16"], state["bf16"]) and torch.equal(get(h)["bf16"], state["bf16"])
    drop(h)


def test_handles_reuse_buffers_without_aliasing():
    from flexmarl_core.training import handles

    state = {"w": torch.randn(1000), "m": torch.randn(1000)}
    sizes = []
    for _ in range(5):
        h = put(state, "memory")
        got = get(h)
        _assert_same_state(got, state)
        drop(h)
        del got
        sizes.append(len(handles._POOL._bufs))
    assert len(set(sizes[1:])) == 1  # steady state (the first cycle may evict older spares)
    handles.trim_buffers()
    # no spare buffer is left; one still in use elsewhere in this process stays (the pool is
    # process-wide, and an earlier test's state may still hold one until it is collected)
    assert handles._POOL._free() == []
    # Buffers in use are never handed out again.
    h = put(state, "memory")
    kept = get(h)
    h2 = put({"w": torch.zeros(1000), "m": torch.zeros(1000)}, "memory")
    other = get(h2)
    other["w"].fill_(5.0)
    _assert_same_state(kept, state)
    _assert_same_state(get(h), state)
    drop(h), drop(h2)


def test_handle_missing_file_names_the_path(tmp_path):
    path = tmp_path / "gone.state"
    h = put({"w": torch.ones(3)}, str(path))
    drop(h)
    with pytest.raises(FileNotFoundError, match="gone.state"):
        get(h)


def test_handles_reject_unsupported_leaves(tmp_path):
    with pytest.raises(TypeError, match=r"state\['opt'\]\[0\] is a object"):
        put({"opt": [object()]}, "memory")


def test_handles_refuse_files_of_another_format(tmp_path):
    from flexmarl_core.training import StateHandle

    torch.save({"w": torch.zeros(2)}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="not a flexmarl trainer state file"):
        get(StateHandle("file", str(tmp_path / "old.pt"), 0))


def test_weights_include_lm_head_and_step_changes_version():
    t = trainer()
    assert isinstance(t, TrainBackend)
    w = t.weights()
    assert "lm_head.weight" in w and torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    w["lm_head.weight"].zero_()  # a copy: the model is untouched
    assert t.model.lm_head.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="accumulate"):
        t.step()
    stats = t.accumulate(random_samples(2), 0.1)
    assert {"loss", "pg_loss", "clip_frac"} <= set(stats)
    res = t.step()
    assert res.version == t.version == 1 and res.num_micro_batches == 1 and res.grad_norm > 0


def test_a_global_batch_without_a_sample_advances_the_version_and_leaves_the_weights():
    """An agent a program never called this iteration gets empty micro-batches: no update (an
    optimizer step on zero gradients would still move the weights by momentum), one version."""
    t = trainer()
    t.accumulate(random_samples(2), 0.1)
    t.step()  # momentum is non-zero from here on
    before = copy.deepcopy(t.weights())
    assert t.accumulate([], 0.1) == {} and t.accumulate([], 0.1) == {}
    res = t.step()
    assert res.version == t.version == 2 and res.num_micro_batches == 2 and res.grad_norm == 0.0
    assert_same_tensors(t.weights(), before)
    t.accumulate([], 0.1)
    t.accumulate(random_samples(2, seed=1), 0.1)  # one sample in the batch: a real step
    assert t.step().grad_norm > 0
    assert any(not torch.equal(v, before[k]) for k, v in t.weights().items())


def test_which_micro_batches_had_samples_survives_a_state_and_a_helper():
    """A state taken mid-batch keeps whether a sample was accumulated (a swap between the
    micro-batches of one step must not turn it into no update), and a gradient helper's
    gradient counts as a filled micro-batch."""
    a = trainer(tiny_model(0))
    a.accumulate(random_samples(2), 0.1)
    a.step()
    a.accumulate(random_samples(2, seed=3), 0.1)
    b = trainer(tiny_model(7))
    b.load_state(a.state())
    ra, rb = a.step(), b.step()
    assert ra.grad_norm == rb.grad_norm > 0
    assert_same_tensors(a.weights(), b.weights())
    helper = trainer(tiny_model(0))
    helper.set_weights(a.weights(), a.version)
    helper.accumulate(random_samples(2, seed=4), 0.1)
    before = copy.deepcopy(a.weights())
    a.add_grads(helper.take_grads())  # the whole step's gradient came from a helper
    assert a.step().grad_norm > 0
    assert any(not torch.equal(v, before[k]) for k, v in a.weights().items())


def test_training_raises_logprob_of_rewarded_response():
    s = random_samples(1, seed=4)[0]
    s.loss_mask = None
    t = trainer(algo=AlgorithmConfig(lr=3e-3))
    before = sum(t.logprobs([s])[0])
    for _ in range(3):
        lp = t.logprobs([s])[0]  # on-policy: old logprobs = current ones
        t.accumulate([Sample(s.prompt_ids, s.response_ids, lp, advantage=1.0)], 1 / len(lp))
        t.step()
    assert sum(t.logprobs([s])[0]) > before + 0.5


def test_make_trainer_reference_bf16_and_backend_errors():
    agent = AgentConfig(name="solver", template="{input}", algorithm={"kl_coef": 0.05, "bf16": True})
    t = make_trainer(agent, tiny_model())
    assert t.ref_model is not None and not any(p.requires_grad for p in t.ref_model.parameters())
    stats = t.accumulate(random_samples(3), 0.05)
    assert torch.isfinite(torch.tensor(stats["loss"])) and "kl" in stats
    t.step()
    assert "ref_model" in t.state()
    plain = make_trainer(AgentConfig(name="a", template="{input}"), tiny_model())
    assert plain.ref_model is None


def test_collate_layout_and_errors():
    s = Sample([5, 6, 7], [8, 9], [-1.0, -2.0], 0.5)
    b = collate([s, Sample([4], [3, 2, 1], [-1.0] * 3, -1.0, [1, 0, 1])], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 1, 0]]
    assert b.target_index.tolist() == [[2, 3, 0], [0, 1, 2]]
    assert b.mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    with pytest.raises(ValueError, match="logprobs"):
        collate([Sample([1], [2, 3], [-1.0], 0.0)])
    with pytest.raises(ValueError, match="nothing to train on"):
        global_loss_scale([[Sample([1], [2], [-1.0], 0.0, [0])]], lambda mb: 0.0)


def test_lr_warm_up_scales_each_step_and_continues_after_a_state_round_trip():
    """With `lr_warmup_steps=4` the step making version v+1 runs at lr·(v+1)/4, then at lr. Adam's
    update is elementwise in the rate, so the same gradients move every weight by exactly that
    fraction of the unwarmed update. A trainer rebuilt from a
    state continues the schedule, since the rate follows the restored version."""
    algo = AlgorithmConfig(lr=1e-3)
    plain, warm = trainer(algo=algo), trainer(algo=algo, lr_warmup_steps=4)
    assert [warm.lr_at(v) for v in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])

    def moved(t, seed):
        before = t.weights()
        t.accumulate(random_samples(3, seed=seed), 0.1)
        t.step()
        return torch.cat([(t.weights()[k] - before[k]).flatten() for k in before])

    # Adam's first update is lr * g / (|g| + eps): the ratio is the schedule's, gradient aside.
    # Updates of at least a tenth of lr: a difference of fp32 weights of ~0.1 then carries a
    # rounding error under 1e-8 / 2.5e-5, far inside rtol.
    first_plain, first_warm = moved(plain, 0), moved(warm, 0)
    nz = first_plain.abs() > 1e-4
    ratio = first_warm[nz] / first_plain[nz]
    assert torch.allclose(ratio, torch.full_like(ratio, 0.25), rtol=1e-3)

    # Two more steps, then a round trip through the state: step 4 runs at 1e-3 in both.
    for seed in (1, 2):
        moved(warm, seed)
    resumed = trainer(algo=algo, lr_warmup_steps=4)
    resumed.load_state(warm.state())
    assert resumed.version == 3 and resumed.lr_at(resumed.version) == pytest.approx(1e-3)
    step_warm, step_resumed = moved(warm, 3), moved(resumed, 3)
    assert torch.equal(step_warm, step_resumed)
    assert warm.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
