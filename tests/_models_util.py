"""Shared helpers for the model / inference / training / algorithm tests (not a conftest)."""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from pathlib import Path

import torch

from flexmarl_core.algorithms import make_loss_fn, token_weight
from flexmarl_core.config import AlgorithmConfig, ModelConfig
from flexmarl_core.models import build_model, get_tokenizer
from flexmarl_core.training import Sample, TorchTrainer

# Tiny models on a shared, noisy 2-core box: one thread avoids OpenMP contention (measured 2-4x
# faster for the 1M model under load). Tests are the caller; library code never sets this.
torch.set_num_threads(1)


@functools.cache
def cache_dir() -> Path:
    """One throw-away model cache per test process (never ~/.cache)."""
    d = Path(tempfile.mkdtemp(prefix="flexmarl-test-cache-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


@functools.cache
def tokenizer():
    return get_tokenizer(cache_dir())


def tiny_model(seed: int = 0):
    return build_model(ModelConfig(preset="tiny-1m"), seed=seed, tokenizer=tokenizer())


def trainer(model=None, *, algo: AlgorithmConfig | None = None, **kw) -> TorchTrainer:
    algo = algo or AlgorithmConfig(lr=1e-3)
    return TorchTrainer(
        model if model is not None else tiny_model(),
        loss_fn=make_loss_fn(algo),
        loss_weight_fn=token_weight,
        lr=algo.lr,
        max_grad_norm=algo.max_grad_norm,
        **kw,
    )


def random_samples(n: int, seed: int = 0, *, vocab: int = 1000) -> list[Sample]:
    """Samples with varied prompt/response lengths, random old logprobs and advantages."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(3, 12), rng.randint(2, 10)
        out.append(
            Sample(
                prompt_ids=[rng.randrange(3, vocab) for _ in range(p)],
                response_ids=[rng.randrange(3, vocab) for _ in range(r)],
                logprobs=[-rng.uniform(5.5, 8.0) for _ in range(r)],
                advantage=rng.uniform(-1, 1),
                loss_mask=[int(rng.random() > 0.2) for _ in range(r)],
            )
        )
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def train_one_worker(cfg, **kwargs):
    """Prepare `cfg`'s run and train it on one in-process worker (`ThreadExecutor`, tags rollout
    and train); returns `(run_dir, run.train's result)`. `kwargs` go to `run.train`."""
    from flexmarl_core import run
    from flexmarl_core.executors import ThreadExecutor, stage_fn

    run_dir = run.prepare_run(cfg)
    ex = ThreadExecutor(stage_fn(str(run_dir)), {"w0": {"rollout": 1, "train": 1}})
    try:
        return run_dir, run.train(cfg, run_dir, ex, **kwargs)
    finally:
        ex.close()
