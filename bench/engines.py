"""Engine speed vs plain transformers / torch on the SAME batch, side by side in one run.

What it measures, per preset (tiny-1m, tiny-10m, tiny-50m; --quick skips 50m):

* generate: 32 prompts x 64 new tokens (--gen-batch, --gen-new), sampling at temperature 1
  (no top-k/top-p), fp32.
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

--no-train: generate rows only (no train step, no DeepSpeed), for models where a train step
takes too long (`small-0.5b`). vLLM then takes turns with the HF engine and plain generate in
one loop, on the same weights and batch, the order rotated every repeat; its row has tokens/s
and start time (`vs_engine` = vLLM / HF engine tokens/s), no weight push.

LoRA team rows (`lora_team`, per preset, in bench/engines_lora.py; --lora-agents N, default 3, rank
8 on every linear layer; skipped without peft): memory of N agents as adapters on one base against
N full models, counted as the bytes of distinct tensor storages the objects hold (exact, unlike RSS
on a shared box): `full_infer_bytes` (N engines) vs `lora_infer_bytes` (one shared-base engine with
N adapters), `full_train_bytes` vs `lora_train_bytes` (N trainers after one AdamW step: weights,
grads, Adam moments; LoRA: one frozen fp32 base + N adapters' states), `*_ratio` = lora / full;
`full_swap_bytes` vs `lora_swap_bytes` (one agent's trainer state, what an on-demand swap moves)
and `full_sync_bytes` vs `lora_sync_bytes` (one published weights version); `mixed_gen_tok_s` (one
batch mixing the N adapters) vs `full_gen_tok_s` (the same batch on one full model).

Runs are interleaved (engine, plain; plain, engine; ...) after a warm-up, so machine noise hits
both sides alike; ratios use the best run of each side (on a shared, loaded box the best run is the
least disturbed one), medians are in the JSON too. Targets: gen_ratio = engine/plain tokens/s >= 0.9 and
step_ratio = engine/plain seconds <= 1.1. Torch threads = 2 (--threads).

    .venv/bin/python bench/engines.py --json /tmp/engines.json --quick
    .venv/bin/python bench/engines.py --no-train --lora-agents 0 --presets tiny-1m,small-0.5b \
        --gen-batch 8 --gen-new 32 --reps 3 --json /tmp/engines-vllm.json
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


def bench_generate(model, tok, reps: int, *, batch: int = GEN_BATCH, new: int = GEN_NEW,
                   vllm: bool = False) -> tuple[dict[str, list[float]], dict]:
    """Tokens/s of each side over `reps` runs on one batch: the HF engine, plain `model.generate`
    and, with `vllm`, an in-process vLLM engine built from the same weights. After one warm-up
    each, the sides take turns, the order rotated every repeat (A B C, B C A, ...), so a side
    is not always the one that runs after another's cache or thread pool. Returns the tok/s
    per side and `{"order", "vllm_import_s", "vllm_start_s"}` (start: save the weights, build
    the engine)."""
    prompts = gen_prompts(batch)
    engine = HFInferenceEngine(model, tok)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=new)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)

    def run_engine(seed: int, eng=engine) -> float:
        t0 = time.perf_counter()
        gens = eng.generate(prompts, sampling, seed=seed)
        dt = time.perf_counter() - t0
        return batch * max(len(g.response_ids) for g in gens) / dt

    def run_plain(seed: int) -> float:
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **enc, do_sample=True, max_new_tokens=new, temperature=1.0, top_k=None, top_p=1.0
            )
        dt = time.perf_counter() - t0
        return batch * (out.shape[1] - enc["input_ids"].shape[1]) / dt

    sides = {"engine": run_engine, "plain": run_plain}
    info: dict = {"order": []}
    closer = None
    if vllm:
        from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine, _import_vllm

        t0 = time.perf_counter()
        _import_vllm()  # once per process: kept out of the start time
        t1 = time.perf_counter()
        v = VLLMInferenceEngine.from_model(model, tok, max_model_len=512)
        info.update(vllm_import_s=round(t1 - t0, 2), vllm_start_s=round(time.perf_counter() - t1, 2))
        sides["vllm"], closer = (lambda seed: run_engine(seed, v)), v.close
    try:
        for run in sides.values():  # warm-up
            run(0)
        names, out = list(sides), {k: [] for k in sides}
        for r in range(reps):
            order = names[r % len(names):] + names[: r % len(names)]
            info["order"].append(order)
            for k in order:
                out[k].append(sides[k](r + 1))
    finally:
        if closer is not None:
            closer()
    return out, info


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


def bench_vllm(model, tok, reps: int, batch: int = GEN_BATCH, new: int = GEN_NEW) -> dict:
    """vLLM generate tokens/s on the engine benchmark's batch, start and weight-push times."""
    from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine

    prompts = gen_prompts(batch)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=new)
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
            tok_s.append(batch * max(len(g.response_ids) for g in gens) / (time.perf_counter() - t0))
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


def scale_out_rows(presets: list[str], tok, reps: int, batch: int = GEN_BATCH, new: int = GEN_NEW) -> dict:
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
        row = bench_vllm(model, tok, reps, batch, new)
        out.setdefault("vllm", {})[preset] = row
        print(f"vllm      {preset:<10} {row['gen_tok_s']:>8.0f} tok/s | start {row['start_s']:.1f} s | "
              f"push {row['push_s'] * 1e3:.0f} ms")
    return out


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
            ("hf/torch", row["engine_gen_tok_s"], row.get("engine_step_s"), None, None, None),
            ("plain", row["plain_gen_tok_s"], row.get("plain_step_s"), None, None, None),
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


def preset_row(preset: str, tok, reps: int, args: argparse.Namespace, vllm: bool) -> tuple[dict, dict]:
    """One preset's HF/torch row (generate and, unless --no-train, the train step) and, with
    `vllm`, its vLLM row from the same interleaved generate loop."""
    model = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
    gen, info = bench_generate(model, tok, reps, batch=args.gen_batch, new=args.gen_new, vllm=vllm)
    e_tok, p_tok = max(gen["engine"]), max(gen["plain"])
    row = {"preset": preset, "params": num_params(model), "engine_gen_tok_s": round(e_tok, 1),
           "plain_gen_tok_s": round(p_tok, 1), "gen_ratio": round(e_tok / p_tok, 3),
           "median": {f"{k}_gen_tok_s": round(statistics.median(v), 1) for k, v in gen.items()}}
    vl = {}
    if vllm:
        vl = {"gen_tok_s": round(max(gen["vllm"]), 1), "gen_tok_s_median": round(statistics.median(gen["vllm"]), 1),
              "start_s": info["vllm_start_s"], "import_s": info["vllm_import_s"], "vs_engine": round(max(gen["vllm"]) / e_tok, 3)}
        row["runs"] = {"order": info["order"], **{k: [round(x, 1) for x in v] for k, v in gen.items()}}
    if not args.no_train:
        step_e, step_p = bench_train(model, train_batch(len(tok)), reps)
        row.update(engine_step_s=round(min(step_e), 4), plain_step_s=round(min(step_p), 4),
                   step_ratio=round(min(step_e) / min(step_p), 3))
        row["median"].update(engine_step_s=_median(step_e), plain_step_s=_median(step_p))
    step = (f"{row['engine_step_s']:>13.3f} {row['plain_step_s']:>12.3f} {row['step_ratio']:>6.2f}"
            if "step_ratio" in row else "train skipped")
    print(f"{preset:<10} {row['params'] / 1e6:>6.1f}M | {e_tok:>12.0f} {p_tok:>11.0f} "
          f"{row['gen_ratio']:>6.2f} | {step}" + (f" | vllm {vl['gen_tok_s']:.0f} tok/s, start "
                                                  f"{vl['start_s']:.1f} s" if vl else ""), flush=True)
    return row, vl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="skip tiny-50m and use 4 repetitions")
    ap.add_argument("--presets", nargs="*", default=None,
                    help="override the preset list (space- or comma-separated, e.g. tiny-1m,small-0.5b)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per side")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--gen-batch", type=int, default=GEN_BATCH, help="prompts per generate batch")
    ap.add_argument("--gen-new", type=int, default=GEN_NEW, help="new tokens per prompt")
    ap.add_argument("--no-train", action="store_true",
                    help="generate rows only (no train step, no DeepSpeed); vLLM joins the generate loop")
    ap.add_argument("--no-scale-out", action="store_true", help="skip the vLLM / DeepSpeed rows")
    ap.add_argument("--lora-agents", type=int, default=3, help="team size of the LoRA rows (0 skips them)")
    ap.add_argument("--only-lora", action="store_true", help="only the LoRA team rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    presets = [p for x in args.presets or () for p in x.split(",") if p] or (
        ["tiny-1m", "tiny-10m"] if args.quick else ["tiny-1m", "tiny-10m", "tiny-50m"])
    reps = args.reps or (4 if args.quick else 6)
    import importlib.util
    import sys

    sys.path.insert(0, str(Path(__file__).parent))  # bench/, run as a script or imported
    from _fresh import provenance

    # vLLM takes turns with the HF sides only without DeepSpeed after it (see scale_out_rows).
    in_loop = args.no_train and not (args.no_scale_out or args.only_lora)
    vllm = in_loop and importlib.util.find_spec("vllm") is not None
    with provenance(Path(__file__).resolve().parents[1]) as prov:
        load_start = os.getloadavg()  # other jobs on the box make absolute numbers meaningless
        tok = get_tokenizer()
        rows, scale_out = [], {}
        print(f"{'preset':<10} {'params':>7} | {'engine tok/s':>12} {'plain tok/s':>11} {'ratio':>6} | "
              f"{'engine step s':>13} {'plain step s':>12} {'ratio':>6}")
        for preset in presets if not args.only_lora else ():
            row, vl = preset_row(preset, tok, reps, args, vllm)
            rows.append(row)
            if vl:
                scale_out.setdefault("vllm", {})[preset] = vl
        if in_loop:
            if not vllm:
                scale_out["vllm"] = {"skipped": "vllm not importable: `make setup-scale` installs it"}
            scale_out["deepspeed"] = {"skipped": "--no-train"}
        elif not (args.no_scale_out or args.only_lora):
            scale_out = scale_out_rows(presets, tok, reps, args.gen_batch, args.gen_new)
        from engines_lora import lora_rows

        lora_team = lora_rows(presets, tok, args.lora_agents, reps, gen_prompts(args.gen_batch), args.gen_new,
                              train_batch(len(tok))[:4])
    result = {
        "bench": "engines",
        "setup": {
            "generate": f"batch {args.gen_batch} x {args.gen_new} new tokens, temperature 1, fp32",
            "gen_batch": args.gen_batch, "gen_new": args.gen_new,
            "train": "skipped (--no-train)" if args.no_train else
            f"{TRAIN_BATCH} x {TRAIN_LEN} tokens ({TRAIN_PROMPT} prompt), fp32, AdamW",
            "ratios": "best run per side; gen_ratio = engine/plain tokens/s (>= 0.9 ok), "
            "step_ratio = engine/plain s (<= 1.1 ok); vllm vs_engine = vllm/engine tokens/s",
            "reps": reps,
            "threads": args.threads,
            "vllm": "in the generate loop, order rotated each repeat" if vllm else "after DeepSpeed",
        },
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        **prov,
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
