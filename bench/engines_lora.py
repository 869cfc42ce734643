"""The LoRA team rows of `bench/engines.py` (see its docstring): N LoRA agents on one base
against N full models, in bytes of the tensors held and mixed-batch tokens/s."""

from __future__ import annotations

import copy
import importlib.util
import time

import torch

from flexmarl_core.algorithms import make_loss_fn, token_weight
from flexmarl_core.config import AlgorithmConfig, ModelConfig, SamplingConfig
from flexmarl_core.inference import HFInferenceEngine
from flexmarl_core.models import build_model, num_params
from flexmarl_core.training import Sample, TorchTrainer, TrainerOptions


def _storage_bytes(*objs) -> int:
    """Bytes of the distinct tensor storages reachable from modules, trainers and dicts."""
    seen: dict[int, int] = {}

    def visit(x) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(x, torch.nn.Module):
            for t in [*x.parameters(), *x.buffers()]:
                visit(t)
                if t.grad is not None:
                    visit(t.grad)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, list | tuple):
            for v in x:
                visit(v)
        elif hasattr(x, "optimizer"):  # a trainer: its module, flat buffers and Adam state
            visit(x.model)
            visit([x._flat, x._flat_grad])
            visit(list(x.optimizer.state.values()))

    for o in objs:
        visit(o)
    return sum(seen.values())


def bench_lora_team(preset: str, tok, n: int, reps: int, prompts: list[str], new: int,
                    samples: list[Sample]) -> dict:
    """N LoRA agents on one base vs N full models: memory, swap/sync bytes, mixed-batch speed."""
    from flexmarl_core.config import LoraSpec
    from flexmarl_core.inference.lora_engine import SharedBaseEngine
    from flexmarl_core.models.lora import SharedBase, initial_adapter_state
    from flexmarl_core.training.lora_trainer import LoraTrainer

    base = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
    spec = LoraSpec(rank=8)
    agents = [f"agent{i}" for i in range(n)]
    loss = make_loss_fn(AlgorithmConfig())
    # Inference: N full engines vs one shared-base engine with N adapters.
    full_engines = [HFInferenceEngine(copy.deepcopy(base), tok) for _ in agents]
    shared = SharedBaseEngine(copy.deepcopy(base), tok)
    for a in agents:
        shared.add(a, spec, initial_adapter_state(base, spec, seed=0, agent=a), version=0)
    full_infer = _storage_bytes(*[e.model for e in full_engines])
    lora_infer = _storage_bytes(shared.model)
    names = [agents[i % n] for i in range(len(prompts))]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new)
    mixed_s, full_s = [], []
    for r in range(reps + 1):  # interleaved, the first of each is a warm-up
        t0 = time.perf_counter()
        shared.generate_mixed(prompts, names, sampling, seed=r)
        t1 = time.perf_counter()
        full_engines[0].generate(prompts, sampling, seed=r)
        t2 = time.perf_counter()
        if r:
            mixed_s.append(t1 - t0)
            full_s.append(t2 - t1)
    del full_engines, shared
    # Training: N full trainers vs N adapter trainers on one fp32 base, after one step each.
    full_tr = [TorchTrainer(copy.deepcopy(base), TrainerOptions(loss, token_weight)) for _ in agents]
    sb = SharedBase(copy.deepcopy(base))
    lora_tr = []
    for a in agents:
        sb.add(a, spec)
        lora_tr.append(LoraTrainer(sb, a, TrainerOptions(loss, token_weight)))
    for tr in [*full_tr, *lora_tr]:
        tr.accumulate(samples, loss_scale=1e-3)
        tr.step()
    toks = len(prompts) * new
    row = {
        "agents": n, "rank": spec.rank, "base_params": num_params(base),
        "adapter_params": sum(p.numel() for _, p in sb.adapter_params(agents[0])),
        "full_infer_bytes": full_infer, "lora_infer_bytes": lora_infer,
        "infer_ratio": round(lora_infer / full_infer, 4),
        "full_train_bytes": _storage_bytes(*full_tr), "lora_train_bytes": _storage_bytes(sb.model, *lora_tr),
        "full_swap_bytes": _storage_bytes(full_tr[0].state()), "lora_swap_bytes": _storage_bytes(lora_tr[0].state()),
        "full_sync_bytes": _storage_bytes(full_tr[0].weights()), "lora_sync_bytes": _storage_bytes(lora_tr[0].weights()),
        "mixed_gen_tok_s": round(toks / min(mixed_s), 1), "full_gen_tok_s": round(toks / min(full_s), 1),
    }
    row["train_ratio"] = round(row["lora_train_bytes"] / row["full_train_bytes"], 4)
    return row


def lora_rows(presets: list[str], tok, n: int, reps: int, prompts: list[str], new: int,
              samples: list[Sample]) -> dict:
    """The LoRA team rows per preset (`n` agents; none for n = 0), or why they were skipped."""
    if n <= 0:
        return {}
    if importlib.util.find_spec("peft") is None:
        return {"skipped": "peft not importable: pip install 'flexmarl[peft]'"}
    out = {}
    for preset in presets:
        lr = out[preset] = bench_lora_team(preset, tok, n, reps, prompts, new, samples)
        print(f"lora team {preset:<10} {lr['agents']} agents: inference {lr['lora_infer_bytes'] / 1e6:.1f} MB "
              f"vs {lr['full_infer_bytes'] / 1e6:.1f} MB full ({lr['infer_ratio']:.2f}x), training "
              f"{lr['lora_train_bytes'] / 1e6:.1f} vs {lr['full_train_bytes'] / 1e6:.1f} MB "
              f"({lr['train_ratio']:.2f}x), swap {lr['lora_swap_bytes'] / 1e3:.0f} vs "
              f"{lr['full_swap_bytes'] / 1e3:.0f} kB, mixed batch {lr['mixed_gen_tok_s']:.0f} vs "
              f"{lr['full_gen_tok_s']:.0f} tok/s")
    return out
