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
from flexmarl_core.training import Sample, TorchTrainer, TrainerOptions, global_loss_scale

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


def options(algo: AlgorithmConfig | None = None, **kw) -> tuple[TrainerOptions, dict]:
    """(`TrainerOptions` of `algo` with the options among `kw`, the rest of `kw`)."""
    algo = algo or AlgorithmConfig(lr=1e-3)
    names = set(TrainerOptions.__dataclass_fields__)
    opts = TrainerOptions(make_loss_fn(algo), token_weight, lr=algo.lr, max_grad_norm=algo.max_grad_norm,
                          **{k: v for k, v in kw.items() if k in names})
    return opts, {k: v for k, v in kw.items() if k not in names}


def trainer(model=None, *, algo: AlgorithmConfig | None = None, **kw) -> TorchTrainer:
    opts, rest = options(algo, **kw)
    return TorchTrainer(model if model is not None else tiny_model(), opts, **rest)


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
    from flexmarl_core.driver import run
    from flexmarl_core.sim.threads import ThreadExecutor, stage_fn

    run_dir = run.prepare_run(cfg)
    ex = ThreadExecutor(stage_fn(str(run_dir)), {"w0": {"rollout": 1, "train": 1}})
    try:
        return run_dir, run.train(cfg, run_dir, ex, **kwargs)
    finally:
        ex.close()


class ScriptedLM(torch.nn.Module):
    """A real tiny transformer steered along scripts: wherever the context so far is a script's
    prompt plus the first k tokens of its continuation (k >= 0), the logit of the script's next
    token gets `boost` added. The steer depends on the context's token ids only, so the engine
    (prefill + KV-cache decode) and a trainer (one pass over the whole sequence) compute the
    same logits; elsewhere the model is the plain transformer.

    Greedy decoding follows a script exactly once `boost` exceeds the base model's logit range
    (a random tiny model's logits span well under 1). Sampling at temperature 1 leaves it with
    probability at most `V * exp(-boost)` per token (V the vocabulary), so a test's margin is
    written down rather than learned."""

    def __init__(self, base, scripts: list[tuple[list[int], list[int]]], boost: float) -> None:
        super().__init__()
        self.base = base
        self.config = base.config
        self.generation_config = base.generation_config
        self.boost = boost
        #: context (prompt + continuation so far) -> the script's next token
        self.next: dict[tuple[int, ...], int] = {}
        for prompt, continuation in scripts:
            seq = [*prompt, *continuation]
            for k in range(len(prompt), len(seq)):
                self.next[tuple(seq[:k])] = seq[k]

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, use_cache=use_cache,
                        logits_to_keep=logits_to_keep, **kwargs)
        ids = input_ids.tolist()
        if past_key_values is not None:  # a decode step: the contexts ride on the cache
            rows = past_key_values.script_rows
            for row, new in zip(rows, ids, strict=True):
                row += new
            contexts = [[tuple(row)] for row in rows]
        else:
            length = len(ids[0])
            if isinstance(logits_to_keep, torch.Tensor):
                kept = logits_to_keep.tolist()
            else:
                kept = list(range(length - logits_to_keep if logits_to_keep else 0, length))
            firsts = [0] * len(ids)
            if attention_mask is not None:  # left padding: a row's tokens start at its first 1
                firsts = [m.index(1) for m in attention_mask.tolist()]
            contexts = [[tuple(row[first : t + 1]) for t in kept] for row, first in zip(ids, firsts, strict=True)]
            if use_cache:
                cache = out.past_key_values
                cache.script_rows = [list(row[first:]) for row, first in zip(ids, firsts, strict=True)]
                select = cache.batch_select_indices

                def follow(indices, cache=cache, select=select) -> None:
                    # the engine picks or copies rows (ended requests leave, a group's rows share a
                    # prefill): each row's context follows its cache row
                    select(indices)
                    cache.script_rows = [list(cache.script_rows[i]) for i in indices.tolist()]
                cache.batch_select_indices = follow
        bias = torch.zeros_like(out.logits)
        for b, row in enumerate(contexts):
            for j, ctx in enumerate(row):
                nxt = self.next.get(ctx)
                if nxt is not None:
                    bias[b, j, nxt] = self.boost
        out.logits = out.logits + bias
        return out


def calling_model(tool_close: str, *, seed: int = 0, gap: float = 0.6):
    """A tiny model that writes `tool_close` (the calculator's `]`) often whatever its context,
    so a rollout calls the tool by construction, on any engine that loads its weights.

    Every layer's output projections are zero, so each position's hidden state is its token's
    embedding and the model is a bigram table; every embedding row carries a shared direction
    `u`, and the close marker's row `gap` more of it (tied embeddings: that row is also its
    logit row), so the marker's logit leads every other token's after any token;
    `calling_floor` gives the least probability of the marker over every context, exactly."""
    model = tiny_model(seed=seed)
    tok = tokenizer()
    close = tok.encode(tool_close, add_special_tokens=False)
    if len(close) != 1:
        raise ValueError(f"{tool_close!r} is {len(close)} tokens; the crafted model needs one")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.get_input_embeddings().weight  # (V, H), tied to lm_head
        u = torch.randn(emb.shape[1], generator=g)
        u /= u.norm()
        emb += u
        emb[close[0]] += gap * u
    return model


def calling_floor(model, token: int, temperature: float) -> float:
    """min over every context token x of P(token | x) at `temperature`: the model's logits
    depend on the last token only (see `calling_model`), so this is exact."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        ids = torch.arange(vocab).unsqueeze(1)  # (V, 1): each token alone as the context
        logits = model(input_ids=ids).logits[:, -1].float()  # (V, V)
    return float(torch.softmax(logits / temperature, dim=-1)[:, token].min())


#: Qwen2.5-0.5B-Instruct's `config.json` as the hub publishes it: its shape, which the memory
#: plan reads (494M parameters, the `small-0.5b` preset's), without its 1 GB of weights
QWEN_05B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "max_window_layers": 21, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True,
}


def publish(cache: Path, repo: str, commit: str, *, seed: int = 0, config: dict | None = None) -> Path:
    """What `hf download` leaves in a hub cache (`HF_HUB_CACHE`, or `HF_HOME`/hub): the snapshot
    folder `models--org--name/snapshots/<commit>/` and the branch's ref. By default a tiny Qwen2
    model (`tiny_model(seed)`) with the local tokenizer and its chat template; with `config`, only
    that config.json (enough for config load and the memory plan, not for loading weights)."""
    import json

    from flexmarl_core.models import save_model

    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    if config is None:
        save_model(tiny_model(seed=seed), tokenizer(), snap)
    else:
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text(json.dumps(config))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


def assert_trains_alike(ref: TorchTrainer, other: TorchTrainer, samples: list[Sample]) -> tuple[dict, dict]:
    """`other`, a trainer of another batch layout, scores and trains `samples` as `ref` does:
    the same log-probs, loss and gradients within bounds from fp32. Returns both `accumulate`
    outputs for the layout's own checks."""
    import pytest  # here: benches import this module's models without the test runner

    # fp32 log-probs of about -7.5 (the untrained model over 1,024 tokens), computed in rows of
    # another shape: within 8 ulps at magnitude 8 (a sample that saw another's tokens is off by ~0.1)
    for a, b in zip(ref.logprobs(samples), other.logprobs(samples), strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=8 * torch.finfo(torch.float32).eps * 8)
    scale = global_loss_scale([samples], ref.loss_weight)
    out_ref, out_other = ref.accumulate(samples, scale), other.accumulate(samples, scale)
    assert out_other["loss"] == pytest.approx(out_ref["loss"], rel=1e-5, abs=1e-7)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    eps = torch.finfo(torch.float32).eps
    for (name, p), q in zip(ref.model.named_parameters(), other.model.parameters(), strict=True):
        # the same terms summed in another order (see test_training's accumulation test)
        atol = tokens * eps * float(p.grad.abs().max())
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=atol, msg=name)
    return out_ref, out_other

