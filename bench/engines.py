"""Engine speed vs plain transformers / torch on the SAME batch, side by side in one run.

What it measures, per preset (tiny-1m, tiny-10m, tiny-50m; --quick skips 50m):

* generate: 32 prompts x 64 new tokens, sampling at temperature 1 (no top-k/top-p), fp32.
  `HFInferenceEngine.generate` (our loop, exact logprobs, seeded) vs `model.generate(do_sample=True)`.
  Tokens/s = batch x decode steps / wall time.
* train step: 16 sequences x 128 tokens (32 prompt + 96 response), fp32, PPO-clipped loss:
  `TorchTrainer.accumulate + step` vs a plain torch loop (forward, log_softmax/gather, same loss,
  backward, clip, AdamW, zero_grad).

Scale-out rows (when the extras are importable; otherwise the JSON says why they were skipped):

* vllm: `VLLMInferenceEngine` on the same generate batch (tokens/s; eager mode, in-process, fp32),
  engine start time, and the weight push of a full state dict (`update_weights`, seconds).
* deepspeed: `DeepSpeedTrainer` ZeRO-2 on the same train batch (step seconds), plus the swap of
  its state: `state()` -> `handles.put(memory)` -> `get` -> `load_state` (seconds), and
  DeepSpeed's in-place `offload_states` + `reload_states` (seconds).
* deepspeed_dp2: `DataParallelDeepSpeedTrainer` (backend.training_dp=2) on the same train batch,
  split over 2 ZeRO-2 rank processes (step seconds, rank start seconds). On a 2-core box the two
  ranks share the cores the 1-process trainer had to itself: expect no speed-up there.

The run ends with one table of every row (HF/torch, vLLM, DeepSpeed, DeepSpeed DP-2).

LoRA team rows (`lora_team`, per preset; --lora-agents N, default 3, rank 8 on every linear
layer; skipped without peft): memory of N agents as adapters on one base against N full
models, counted as the bytes of distinct tensor storages the objects hold (exact, unlike RSS
on a shared box): `full_infer_bytes` (N engines) vs `lora_infer_bytes` (one shared-base engine
with N adapters), `full_train_bytes` vs `lora_train_bytes` (N trainers after one AdamW step:
weights, grads, Adam moments; LoRA: one frozen fp32 base + N adapters' states), `*_ratio` =
lora / full; `full_swap_bytes` vs `lora_swap_bytes` (one agent's trainer state, what an
on-demand swap moves) and `full_sync_bytes` vs `lora_sync_bytes` (one published weights
version); `mixed_gen_tok_s` (one batch mixing the N adapters) vs `full_gen_tok_s` (the same
batch on one full model).

Runs are interleaved (engine, plain, engine, ...) after a warm-up, so machine noise hits both
sides alike; ratios use the best run of each side (on a shared, loaded box the best run is the
least disturbed one), medians are in the JSON too. Targets: gen_ratio = engine/plain tokens/s >= 0.9 and
step_ratio = engine/plain seconds <= 1.1. Torch threads = 2 (--threads).

    .venv/bin/python bench/engines.py --json /tmp/engines.json --quick
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from flexmarl_core.algorithms import make_loss_fn, token_weight
from flexmarl_core.config import AlgorithmConfig, ModelConfig, SamplingConfig
from flexmarl_core.inference import HFInferenceEngine
from flexmarl_core.models import build_model, get_tokenizer, num_params
from flexmarl_core.training import Sample, TorchTrainer, TrainerOptions

GEN_BATCH, GEN_NEW = 32, 64
TRAIN_BATCH, TRAIN_PROMPT, TRAIN_LEN = 16, 32, 128


def gen_prompts(n: int) -> list[str]:
    """`n` short arithmetic prompts of mixed lengths (left padding gets exercised)."""
    return [f"question: {i} + {3 * i} * 7 = ?\nplan:" + " step" * (i % 5) for i in range(n)]


def bench_generate(model, tok, reps: int) -> tuple[float, float]:
    prompts = gen_prompts(GEN_BATCH)
    engine = HFInferenceEngine(model, tok)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=GEN_NEW)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)

    def run_engine(seed: int) -> float:
        t0 = time.perf_counter()
        gens = engine.generate(prompts, sampling, seed=seed)
        dt = time.perf_counter() - t0
        return GEN_BATCH * max(len(g.response_ids) for g in gens) / dt

    def run_plain(seed: int) -> float:
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **enc, do_sample=True, max_new_tokens=GEN_NEW, temperature=1.0, top_k=None, top_p=1.0
            )
        dt = time.perf_counter() - t0
        return GEN_BATCH * (out.shape[1] - enc["input_ids"].shape[1]) / dt

    run_engine(0), run_plain(0)  # warm-up
    eng, plain = [], []
    for r in range(reps):
        eng.append(run_engine(r + 1))
        plain.append(run_plain(r + 1))
    return eng, plain


def train_batch(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (TRAIN_BATCH, TRAIN_LEN), generator=g)
    adv = torch.randn(TRAIN_BATCH, generator=g)
    resp = TRAIN_LEN - TRAIN_PROMPT
    return [
        Sample(
            prompt_ids=ids[b, :TRAIN_PROMPT].tolist(),
            response_ids=ids[b, TRAIN_PROMPT:].tolist(),
            logprobs=[-7.0] * resp,
            advantage=float(adv[b]),
        )
        for b in range(TRAIN_BATCH)
    ]


def bench_train(model, samples: list[Sample], reps: int) -> tuple[float, float]:
    algo = AlgorithmConfig(lr=1e-5)
    trainer = TorchTrainer(copy.deepcopy(model), TrainerOptions(make_loss_fn(algo), token_weight, lr=algo.lr))
    plain_model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(plain_model.parameters(), lr=algo.lr, weight_decay=0.0)
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples])
    old = torch.tensor([s.logprobs for s in samples])
    adv = torch.tensor([s.advantage for s in samples]).unsqueeze(-1)
    scale = 1.0 / token_weight(samples)

    def run_engine() -> float:
        return timed_step(trainer, samples, scale)

    def run_plain() -> float:
        t0 = time.perf_counter()
        logits = plain_model(input_ids=ids).logits[:, TRAIN_PROMPT - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, TRAIN_PROMPT:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    run_engine(), run_plain()  # warm-up (allocations, optimizer state)
    eng, plain = [], []
    for _ in range(reps):
        eng.append(run_engine())
        plain.append(run_plain())
    return eng, plain


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def timed_step(trainer, samples: list[Sample], scale: float) -> float:
    """Seconds for one accumulate + optimizer step of `trainer` on `samples`."""
    t0 = time.perf_counter()
    trainer.accumulate(samples, scale)
    trainer.step()
    return time.perf_counter() - t0


def _step_row(step_s: list[float]) -> dict:
    return {"step_s": round(min(step_s), 4), "step_s_median": _median(step_s)}


def bench_vllm(model, tok, reps: int) -> dict:
    """vLLM generate tokens/s on the engine benchmark's batch, start and weight-push times."""
    from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine

    prompts = gen_prompts(GEN_BATCH)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=GEN_NEW)
    t0 = time.perf_counter()
    engine = VLLMInferenceEngine.from_model(model, tok, max_model_len=512)
    start_s = time.perf_counter() - t0
    try:
        engine.generate(prompts, sampling, seed=0)  # warm-up
        tok_s, push_s = [], []
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state.setdefault("lm_head.weight", model.get_output_embeddings().weight.detach().clone())
        for r in range(reps):
            t0 = time.perf_counter()
            gens = engine.generate(prompts, sampling, seed=r + 1)
            tok_s.append(GEN_BATCH * max(len(g.response_ids) for g in gens) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            engine.update_weights(state, r + 1)
            push_s.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return {"gen_tok_s": round(max(tok_s), 1), "gen_tok_s_median": round(statistics.median(tok_s), 1),
            "start_s": round(start_s, 2), "push_s": _median(push_s)}


def bench_deepspeed(model, samples: list[Sample], reps: int) -> dict:
    """DeepSpeed ZeRO-2 step time on the train batch, and swap times of its state."""
    from flexmarl_core.training.deepspeed_trainer import DeepSpeedTrainer
    from flexmarl_core.training.handles import drop, get, put

    algo = AlgorithmConfig(lr=1e-5)
    tr = DeepSpeedTrainer(copy.deepcopy(model), TrainerOptions(make_loss_fn(algo), token_weight, lr=algo.lr),
                          zero_stage=2)
    scale = 1.0 / token_weight(samples)
    step_s, swap_s, offload_s = [], [], []
    for r in range(reps + 1):
        t = timed_step(tr, samples, scale)
        if r:  # the first step is the warm-up
            step_s.append(t)
        t0 = time.perf_counter()
        h = put(tr.state(), "memory")
        tr.load_state(get(h))
        drop(h)
        swap_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tr.offload_states()
        tr.reload_states()
        offload_s.append(time.perf_counter() - t0)
    return {**_step_row(step_s), "state_swap_s": _median(swap_s), "offload_reload_s": _median(offload_s)}


def bench_deepspeed_dp(model, samples: list[Sample], reps: int, dp: int = 2) -> dict:
    """Step time of a `dp`-rank DeepSpeed ZeRO-2 trainer on the train batch (split by samples)."""
    from flexmarl_core.training.dp_trainer import DataParallelDeepSpeedTrainer

    algo = AlgorithmConfig(lr=1e-5)
    t0 = time.perf_counter()
    tr = DataParallelDeepSpeedTrainer(copy.deepcopy(model), TrainerOptions(make_loss_fn(algo), token_weight, lr=algo.lr),
                                      name="bench", dp=dp)
    start_s = time.perf_counter() - t0
    try:
        scale = 1.0 / token_weight(samples)
        step_s = [timed_step(tr, samples, scale) for _ in range(reps + 1)][1:]  # [0]: warm-up
    finally:
        tr.close()
    return {"dp": dp, **_step_row(step_s), "start_s": round(start_s, 2)}


def scale_out_rows(presets: list[str], tok, reps: int) -> dict:
    """vLLM and DeepSpeed rows next to the HF/torch ones, or why they were skipped."""
    import importlib.util

    out: dict = {}
    have = {name: importlib.util.find_spec(name) is not None for name in ("vllm", "deepspeed")}
    for name, ok in have.items():
        if not ok:
            out[name] = {"skipped": f"{name} not importable: `make setup-scale` installs it"}
            print(f"{name}: skipped (not importable; `make setup-scale` installs it)")
    models = {p: build_model(ModelConfig(preset=p), seed=0, tokenizer=tok) for p in presets}
    # DeepSpeed first, for every preset: closing an in-process vLLM engine tears down the
    # torch.distributed world vLLM made, and a later DeepSpeed engine then trips over the
    # process groups DeepSpeed cached from it ("Group ... is not registered").
    for preset, model in models.items() if have["deepspeed"] else ():
        row = bench_deepspeed(model, train_batch(len(tok)), reps)
        out.setdefault("deepspeed", {})[preset] = row
        print(f"deepspeed {preset:<10} step {row['step_s']:.3f} s | state swap "
              f"{row['state_swap_s'] * 1e3:.0f} ms | offload+reload {row['offload_reload_s'] * 1e3:.0f} ms")
        if torch.cuda.is_available() and torch.cuda.device_count() < 2:  # one GPU per rank
            out["deepspeed_dp2"] = {"skipped": f"DP-2 needs 2 GPUs, {torch.cuda.device_count()} visible"}
            continue
        row = bench_deepspeed_dp(model, train_batch(len(tok)), reps)
        out.setdefault("deepspeed_dp2", {})[preset] = row
        print(f"ds dp-2   {preset:<10} step {row['step_s']:.3f} s | rank start {row['start_s']:.1f} s")
    for preset, model in models.items() if have["vllm"] else ():
        row = bench_vllm(model, tok, reps)
        out.setdefault("vllm", {})[preset] = row
        print(f"vllm      {preset:<10} {row['gen_tok_s']:>8.0f} tok/s | start {row['start_s']:.1f} s | "
              f"push {row['push_s'] * 1e3:.0f} ms")
    return out


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


def bench_lora_team(preset: str, tok, n: int, reps: int) -> dict:
    """N LoRA agents on one base vs N full models: memory, swap/sync bytes, mixed-batch speed."""
    from flexmarl_core.config import LoraSpec
    from flexmarl_core.inference.lora_engine import SharedBaseEngine
    from flexmarl_core.models.lora import SharedBase, initial_adapter_state
    from flexmarl_core.training.lora_trainer import LoraTrainer

    base = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
    spec = LoraSpec(rank=8)
    agents = [f"agent{i}" for i in range(n)]
    loss = make_loss_fn(AlgorithmConfig())
    samples = train_batch(len(tok))[:4]
    # Inference: N full engines vs one shared-base engine with N adapters.
    full_engines = [HFInferenceEngine(copy.deepcopy(base), tok) for _ in agents]
    shared = SharedBaseEngine(copy.deepcopy(base), tok)
    for a in agents:
        shared.add(a, spec, initial_adapter_state(base, spec, seed=0, agent=a), version=0)
    full_infer = _storage_bytes(*[e.model for e in full_engines])
    lora_infer = _storage_bytes(shared.model)
    prompts = gen_prompts(GEN_BATCH)
    names = [agents[i % n] for i in range(GEN_BATCH)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=GEN_NEW)
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
    toks = GEN_BATCH * GEN_NEW
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


def print_table(rows: list[dict], scale_out: dict) -> None:
    """Every engine side by side, per preset: generate tok/s, step s, push / swap ms."""
    def cell(v: float | None, width: int, prec: int) -> str:
        return f"{v:>{width}.{prec}f}" if v is not None else f"{'-':>{width}}"

    print(f"\n{'preset':<10} {'engine':<14} {'gen tok/s':>10} {'step s':>8} {'push ms':>8} "
          f"{'swap ms':>8} {'offl ms':>8}")
    for row in rows:
        p = row["preset"]
        vl, ds, dp = (scale_out.get(k, {}).get(p, {}) for k in ("vllm", "deepspeed", "deepspeed_dp2"))
        lines = [
            ("hf/torch", row["engine_gen_tok_s"], row["engine_step_s"], None, None, None),
            ("plain", row["plain_gen_tok_s"], row["plain_step_s"], None, None, None),
            ("vllm", vl.get("gen_tok_s"), None, vl.get("push_s"), None, None),
            ("deepspeed", None, ds.get("step_s"), None, ds.get("state_swap_s"), ds.get("offload_reload_s")),
            ("deepspeed dp-2", None, dp.get("step_s"), None, None, None),
        ]
        for name, tok_s, step, push, swap, offl in lines:
            if (tok_s, step) == (None, None):
                continue  # extra not installed
            ms = [None if x is None else x * 1e3 for x in (push, swap, offl)]
            print(f"{p:<10} {name:<14} {cell(tok_s, 10, 0)} {cell(step, 8, 3)} "
                  f"{cell(ms[0], 8, 0)} {cell(ms[1], 8, 0)} {cell(ms[2], 8, 0)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="skip tiny-50m and use 4 repetitions")
    ap.add_argument("--presets", nargs="*", default=None, help="override the preset list")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per side")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--no-scale-out", action="store_true", help="skip the vLLM / DeepSpeed rows")
    ap.add_argument("--lora-agents", type=int, default=3, help="team size of the LoRA rows (0 skips them)")
    ap.add_argument("--only-lora", action="store_true", help="only the LoRA team rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    presets = args.presets or (["tiny-1m", "tiny-10m"] if args.quick else ["tiny-1m", "tiny-10m", "tiny-50m"])
    reps = args.reps or (4 if args.quick else 6)

    load_start = os.getloadavg()  # other jobs on the box make absolute numbers meaningless
    tok = get_tokenizer()
    rows = []
    print(f"{'preset':<10} {'params':>7} | {'engine tok/s':>12} {'plain tok/s':>11} {'ratio':>6} | "
          f"{'engine step s':>13} {'plain step s':>12} {'ratio':>6}")
    for preset in presets if not args.only_lora else ():
        model = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
        gen_e, gen_p = bench_generate(model, tok, reps)
        step_e, step_p = bench_train(model, train_batch(len(tok)), reps)
        e_tok, p_tok, e_step, p_step = max(gen_e), max(gen_p), min(step_e), min(step_p)
        row = {
            "preset": preset,
            "params": num_params(model),
            "engine_gen_tok_s": round(e_tok, 1),
            "plain_gen_tok_s": round(p_tok, 1),
            "gen_ratio": round(e_tok / p_tok, 3),
            "engine_step_s": round(e_step, 4),
            "plain_step_s": round(p_step, 4),
            "step_ratio": round(e_step / p_step, 3),
            "median": {
                "engine_gen_tok_s": round(statistics.median(gen_e), 1),
                "plain_gen_tok_s": round(statistics.median(gen_p), 1),
                "engine_step_s": round(statistics.median(step_e), 4),
                "plain_step_s": round(statistics.median(step_p), 4),
            },
        }
        rows.append(row)
        print(f"{preset:<10} {row['params'] / 1e6:>6.1f}M | {e_tok:>12.0f} {p_tok:>11.0f} "
              f"{row['gen_ratio']:>6.2f} | {e_step:>13.3f} {p_step:>12.3f} {row['step_ratio']:>6.2f}")
        del model
    scale_out = {} if args.no_scale_out or args.only_lora else scale_out_rows(presets, tok, reps)
    lora_team: dict = {}
    if args.lora_agents > 0:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            lora_team = {"skipped": "peft not importable: pip install 'flexmarl[peft]'"}
        for preset in presets if not lora_team else ():
            lr = lora_team[preset] = bench_lora_team(preset, tok, args.lora_agents, reps)
            print(f"lora team {preset:<10} {lr['agents']} agents: inference {lr['lora_infer_bytes'] / 1e6:.1f} MB "
                  f"vs {lr['full_infer_bytes'] / 1e6:.1f} MB full ({lr['infer_ratio']:.2f}x), training "
                  f"{lr['lora_train_bytes'] / 1e6:.1f} vs {lr['full_train_bytes'] / 1e6:.1f} MB "
                  f"({lr['train_ratio']:.2f}x), swap {lr['lora_swap_bytes'] / 1e3:.0f} vs "
                  f"{lr['full_swap_bytes'] / 1e3:.0f} kB, mixed batch {lr['mixed_gen_tok_s']:.0f} vs "
                  f"{lr['full_gen_tok_s']:.0f} tok/s")
    result = {
        "bench": "engines",
        "setup": {
            "generate": f"batch {GEN_BATCH} x {GEN_NEW} new tokens, temperature 1, fp32",
            "train": f"{TRAIN_BATCH} x {TRAIN_LEN} tokens ({TRAIN_PROMPT} prompt), fp32, AdamW",
            "ratios": "best run per side; gen_ratio = engine/plain tokens/s (>= 0.9 ok), "
            "step_ratio = engine/plain s (<= 1.1 ok)",
            "reps": reps,
            "threads": args.threads,
        },
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        "rows": rows,
        "scale_out": scale_out,
        "lora_team": lora_team,
    }
    print_table(rows, scale_out)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
