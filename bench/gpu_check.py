"""GPU check: the HF engine and the torch trainer on a CUDA device, against the same code on the CPU.

    bash bench/gpu_check.sh --json runs/gpu_check.json [--quick]   # on a machine with a CUDA GPU
    python bench/gpu_check.py --dry-run --json /tmp/gpu.json        # the same script on the CPU

Checks (each a `checks` entry with `passed`; the run exits 1 when one fails):

* greedy_cpu_vs_device/<preset>: the HF engine's greedy (temperature 0) tokens on the device
  equal the same model's on the CPU, fp32. A divergence passes only where the CPU's two candidate
  tokens are closer than the fp32 bound (a legitimate near-tie; the entry names it); logprobs
  match within the bound up to the first divergence.
* logprobs_engine_vs_trainer/<preset>: logprobs the engine samples with on the device equal the
  trainer's recomputation on the device (`TorchTrainer.logprobs`), fp32.
* train_step_fp32|bf16/<preset>: one accumulate + step of `TorchTrainer` on the device against the
  CPU (bf16 = bf16 autocast on both): loss, gradient (relative L2) and grad norm within the
  dtype's bound, and each side's step is AdamW's on its own gradient to fp32 rounding.
* state_swap/<preset>: trainer state (flat fp32 buffers, Adam moments, pending grads) device ->
  `handles.put` (host) -> `get` -> `load_state` into a fresh device trainer is bit-exact, and
  both trainers' next steps are too; swap GB/s next to plain device->host / host->device copies.
* vllm_lora/<preset>: where vLLM imports, LoRA agents on the vLLM backend
  (`inference/vllm_lora.py`: `enable_lora`, a `LoRARequest` per row from the adapter saved as a
  PEFT folder) against the HF `SharedBaseEngine` on the device: a greedy batch mixing three
  agents' adapters gives the same tokens (near-ties aside, as above) and logprobs within the fp32
  bound, and after one agent's adapter is replaced (a weight sync) its rows follow the new one.
* endpoint/<preset>: a team program's calls through the OpenAI-compatible endpoint
  (`programs/gateway.py`) in front of the HF engine on the device and, where vLLM imports, in
  front of vLLM, against the endpoint in front of the HF engine on the CPU: every call recorded
  with the same prompt, its greedy tokens (near-ties aside) and logprobs within the fp32 bound;
  an unknown agent refused with OpenAI's 404 (`bench/gpu_check_endpoint.py`).
* team_run: `flexmarl train configs/tiny.yaml` (Prefect flow, local Dask cluster) for one
  iteration, when prefect, prefect-dask and distributed import. Its workers build their models
  on the device (`cluster.device`: the workers' engines and trainers are built there).
  `team_run/small-0.5b` (not with --dry-run): the same team with every agent the small-0.5b
  preset in bf16 on one worker that holds one trainer state at a time: real-size tokens/s and
  the swap GB/s of the states it moves out and back in.

Throughput (`throughput`): generation tokens/s and train step seconds per preset (up to the
largest that fits) and batch size, device next to CPU. vLLM / DeepSpeed rows (bench/engines.py's
`scale_out_rows`) only where they import. Everything left out is in `skipped`, with the reason.

Tolerances come from the dtype (`rel_tol`), never from a measurement. fp32 matmuls run in full
fp32 (TF32 off: its 10-bit mantissa would need the bf16-class bound).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engines import TRAIN_LEN, gen_prompts, scale_out_rows, train_batch
from bench.swap import assert_exact
from flexmarl_core.algorithms import make_loss_fn, token_weight
from flexmarl_core.config import AlgorithmConfig, ModelConfig, SamplingConfig
from flexmarl_core.inference import HFInferenceEngine
from flexmarl_core.models import build_model, get_tokenizer, num_params
from flexmarl_core.training import Sample, TorchTrainer, TrainerOptions, drop, get, put

REPO = Path(__file__).resolve().parents[1]

CPU = torch.device("cpu")
LR = 1e-4
TEAM_RUN_PACKAGES = ("prefect", "prefect_dask", "dask", "distributed")
ENDPOINT_PACKAGES = ("openai", "starlette", "uvicorn", "jinja2")


@dataclass(frozen=True)
class Plan:
    """What one run measures; `PLANS` holds the full, --quick and --dry-run sizes."""

    presets: tuple[str, ...]  #: throughput presets, smallest first (stops at the first that does not fit)
    check_presets: tuple[str, ...]  #: presets of the correctness checks
    gen_batches: tuple[int, ...]
    gen_new: int  #: new tokens per generate call
    train_batches: tuple[int, ...]  #: sequences of TRAIN_LEN tokens (bench/engines.py's train batch)
    cpu_max_batch: int  #: CPU figures only up to this batch size (larger ones take minutes there)
    reps: int  #: timed repetitions after one warm-up (CPU figures: 1)
    check_prompts: int
    check_new: int
    check_batch: int
    team_iterations: int
    budget_s: float  #: throughput rows stop being added past this many seconds of the run


PLANS = {
    "full": Plan(("tiny-1m", "tiny-10m", "tiny-50m"), ("tiny-1m", "tiny-10m", "tiny-50m"),
                 (8, 32, 128), 64, (4, 16, 64), 32, 3, 16, 32, 16, 1, 300.0),
    "quick": Plan(("tiny-1m", "tiny-10m"), ("tiny-1m",), (8, 64), 32, (4, 32), 16, 2, 8, 16, 8, 1, 150.0),
    "dry": Plan(("tiny-1m",), ("tiny-1m",), (2, 4), 8, (2, 4), 4, 1, 4, 8, 4, 1, 300.0),
}


# -- tolerances -----------------------------------------------------------------------------------
def rel_tol(dtype: torch.dtype, model: torch.nn.Module, *, backward: bool) -> float:
    """Bound on the relative difference (to max |x|, or in L2 for a vector) of a quantity that two
    correct implementations compute in `dtype`.

    u = eps / 2 is the unit roundoff. A Qwen2 layer rounds about 8 results on the forward path
    (q, k, v, attention, o, gate, up, down), backward twice as many again: n = 8 L forward, 24 L
    with backward. Each result is a sum of up to K = intermediate_size products; summed in another
    order (another BLAS, a GPU split-K) it moves by about sqrt(K) u in fp32 (rounding errors as a
    random walk; K u is the worst case). Under bf16 autocast the sums accumulate in fp32 and the
    bf16 rounding of each result dominates: u per op. Independent errors add in quadrature, and
    each implementation is that far from the exact value: 2 sqrt(n) per_op.
    """
    cfg = model.config
    u = torch.finfo(dtype).eps / 2
    per_op = u * math.sqrt(cfg.intermediate_size) if dtype == torch.float32 else u
    n = (24 if backward else 8) * cfg.num_hidden_layers
    return 2 * math.sqrt(n) * per_op


def logit_scale(model: torch.nn.Module, rows: list[list[int]]) -> float:
    """max |logit| of `model` (CPU) over `rows`: the magnitude logprob errors scale with."""
    with torch.inference_mode():
        return max(float(model(input_ids=torch.tensor([r])).logits.abs().max()) for r in rows)


# -- helpers --------------------------------------------------------------------------------------
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def clock(fn: Callable[[], Any], dev: torch.device) -> tuple[float, Any]:
    """Seconds of `fn()` with the device's queue drained on both sides, and its result."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def samples_of(vocab: int, n: int) -> list[Sample]:
    """`n` training samples of TRAIN_LEN tokens: bench/engines.py's train batch, repeated to length."""
    base = train_batch(vocab)
    return (base * -(-n // len(base)))[:n]


def make_trainer(model: torch.nn.Module, dev: torch.device, *, bf16: bool = False) -> TorchTrainer:
    algo = AlgorithmConfig(lr=LR)
    return TorchTrainer(copy.deepcopy(model).to(dev), TrainerOptions(make_loss_fn(algo), token_weight, lr=LR, bf16=bf16))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- checks ---------------------------------------------------------------------------------------
def check_greedy(model: Any, tok: Any, dev: torch.device, plan: Plan) -> dict[str, Any]:
    prompts = gen_prompts(plan.check_prompts)
    sampling = SamplingConfig(temperature=0.0, top_p=1.0, max_new_tokens=plan.check_new)
    want = HFInferenceEngine(copy.deepcopy(model), tok).generate(prompts, sampling, seed=0)
    got = HFInferenceEngine(copy.deepcopy(model).to(dev), tok).generate(prompts, sampling, seed=0)
    tol = rel_tol(torch.float32, model, backward=False)
    scale = logit_scale(model, [w.prompt_ids + w.response_ids for w in want])
    bound = 2 * tol * scale  # each side's logits are within tol * scale of the exact ones
    diverged, lp_diff = [], 0.0
    for row, (w, g) in enumerate(zip(want, got, strict=True)):
        k = next((i for i, (a, b) in enumerate(zip(w.response_ids, g.response_ids, strict=False))
                  if a != b),
                 min(len(w.response_ids), len(g.response_ids)))
        lp_diff = max([lp_diff, *(abs(a - b) for a, b in zip(w.logprobs[:k], g.logprobs[:k], strict=True))])
        if w.response_ids == g.response_ids:
            continue
        if k == min(len(w.response_ids), len(g.response_ids)):  # an EOS would differ at k
            raise AssertionError(f"row {row}: lengths differ ({len(w.response_ids)} vs "
                                 f"{len(g.response_ids)}) with no differing token")
        # A legitimate divergence: on the CPU the two tokens are closer than the logits' bound.
        with torch.inference_mode():
            z = model(input_ids=torch.tensor([w.prompt_ids + w.response_ids[:k]])).logits[0, -1]
        margin = float(z[w.response_ids[k]] - z[g.response_ids[k]])
        diverged.append({"row": row, "step": k, "cpu_token": w.response_ids[k],
                         "device_token": g.response_ids[k], "cpu_margin": margin, "near_tie": margin <= bound})
    passed = lp_diff <= bound and all(d["near_tie"] for d in diverged)
    return {"passed": passed, "rows": len(prompts), "new_tokens": plan.check_new,
            "tokens_equal": not diverged, "rows_diverged": len(diverged),
            "first_divergence": min(diverged, key=lambda d: d["step"]) if diverged else None,
            "divergences": diverged, "max_logprob_diff": lp_diff, "logprob_bound": bound,
            "rel_tol": tol, "logit_scale": scale}


def check_logprobs(model: Any, tok: Any, dev: torch.device, plan: Plan) -> dict[str, Any]:
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=plan.check_new)
    gens = HFInferenceEngine(copy.deepcopy(model).to(dev), tok).generate(
        gen_prompts(plan.check_prompts), sampling, seed=1)
    samples = [Sample(g.prompt_ids, g.response_ids, g.logprobs, 0.0) for g in gens]
    again = make_trainer(model, dev).logprobs(samples)  # the trainer scores at temperature 1 too
    diff = max(abs(a - b) for g, lp in zip(gens, again, strict=True) for a, b in zip(g.logprobs, lp, strict=True))
    tol = rel_tol(torch.float32, model, backward=False)
    bound = 2 * tol * logit_scale(model, [g.prompt_ids + g.response_ids for g in gens])
    return {"passed": diff <= bound, "tokens": sum(len(g.response_ids) for g in gens),
            "max_logprob_diff": diff, "logprob_bound": bound, "rel_tol": tol}


def adamw_step_error(trainer: TorchTrainer, w0: torch.Tensor, g: torch.Tensor, grad_norm: float) -> float:
    """How far `trainer`'s first optimizer step from `w0` with gradient `g` landed from AdamW's,
    in units of the fp32 rounding bound (<= 1: the step is AdamW's).

    A fresh AdamW's first step has m_hat = g and v_hat = g^2, so each weight moves by exactly
    lr g / (|g| + eps), after clip_grad_norm_'s scaling; computed here in fp64. The trainer's fp32
    step rounds the update at most 12 times (m: 2, v: 4, sqrt, division by the bias correction,
    + eps, m / denom, the step size: 2), each by <= u relative (u = fp32 unit roundoff), and the
    final add by u |w1| <= u (|w0| + lr): at most u |w0| + 13 u lr per weight. Norm weights start
    at 1.0, where the final add alone can take half an ulp: ratios just under 1 are normal."""
    u = torch.finfo(torch.float32).eps / 2
    lr = trainer.optimizer.param_groups[0]["lr"]
    eps = trainer.optimizer.param_groups[0]["eps"]
    w0, g = w0.cpu().double(), g.cpu().double() * min(1.0, trainer.max_grad_norm / (grad_norm + 1e-6))
    want = w0 - lr * g / (g.abs() + eps)
    got = trainer.state()["params"].cpu().double()
    return float(((got - want).abs() / (u * w0.abs() + 13 * u * lr)).max())


def check_train_step(model: Any, dev: torch.device, plan: Plan, *, bf16: bool) -> dict[str, Any]:
    ref, dut = make_trainer(model, CPU, bf16=bf16), make_trainer(model, dev, bf16=bf16)
    samples = samples_of(model.config.vocab_size, plan.check_batch)
    scale = 1.0 / token_weight(samples)
    m_ref, m_dut = ref.accumulate(samples, scale), dut.accumulate(samples, scale)
    st_ref, st_dut = ref.state(), dut.state()
    grad_err = rel_l2(st_dut["grads"], st_ref["grads"])
    s_ref, s_dut = ref.step(), dut.step()
    tol = rel_tol(torch.bfloat16 if bf16 else torch.float32, model, backward=True)
    # The loss is a mean of -adv * ratio terms with ratio ~ 1, so mean |adv| is their magnitude.
    loss_scale = abs(m_ref["loss"]) + statistics.fmean(abs(s.advantage) for s in samples)
    loss_diff = abs(m_dut["loss"] - m_ref["loss"])
    gn_err = abs(s_dut.grad_norm - s_ref.grad_norm) / s_ref.grad_norm
    # Equal gradients (within tol) and each side's step being AdamW's on its own gradient make
    # equal steps; the weights themselves may differ by up to 2 lr where a gradient entry is
    # smaller than its rounding noise and its sign differs (the first step moves by lr sign(g)).
    step_err = {side: adamw_step_error(tr, st["params"], st["grads"], s.grad_norm)
                for side, tr, st, s in (("cpu", ref, st_ref, s_ref), ("device", dut, st_dut, s_dut))}
    w_diff = float((dut.state()["params"].cpu() - ref.state()["params"]).abs().max())
    passed = (grad_err <= tol and gn_err <= tol and loss_diff <= tol * loss_scale
              and max(step_err.values()) <= 1.0)
    return {"passed": passed, "dtype": "bf16 autocast" if bf16 else "fp32", "batch": len(samples),
            "rel_tol": tol, "grad_rel_l2": grad_err, "grad_norm_rel_diff": gn_err,
            "loss_device": m_dut["loss"], "loss_cpu": m_ref["loss"], "loss_diff": loss_diff,
            "loss_bound": tol * loss_scale, "adamw_step_error": step_err, "max_weight_diff": w_diff}


def check_swap(model: Any, dev: torch.device, plan: Plan) -> dict[str, Any]:
    samples = samples_of(model.config.vocab_size, plan.check_batch)
    scale = 1.0 / token_weight(samples)
    tr = make_trainer(model, dev)
    tr.accumulate(samples, scale)
    tr.step()
    tr.accumulate(samples, scale)  # pending gradients travel too
    saved = tr.state()
    h = put(saved, "memory")
    fresh = make_trainer(model, dev)
    fresh.load_state(get(h))
    assert_exact(fresh.state(), saved)  # raises with the path of the first difference
    tr.step()
    fresh.step()
    assert_exact(fresh.state()["params"], tr.state()["params"], "params after the next step")
    swap = []
    for _ in range(plan.reps + 1):  # [0] is the warm-up (fresh pool pages)
        t_o, h2 = clock(lambda: put(saved, "memory"), dev)
        t_i, _ = clock(lambda h2=h2: fresh.load_state(get(h2)), dev)
        drop(h2)
        swap.append((t_o, t_i))
    nbytes = h.nbytes
    drop(h)
    dev_buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host_buf = torch.ones(nbytes, dtype=torch.uint8)  # pageable and written once, like the pool's
    d2h = statistics.median(clock(lambda: host_buf.copy_(dev_buf), dev)[0] for _ in range(plan.reps + 1))
    h2d = statistics.median(clock(lambda: dev_buf.copy_(host_buf), dev)[0] for _ in range(plan.reps + 1))
    t_o = statistics.median(o for o, _ in swap[1:])
    t_i = statistics.median(i for _, i in swap[1:])
    return {"passed": True, "bit_exact": True, "bytes": nbytes,
            "swap_out_ms": t_o * 1e3, "swap_in_ms": t_i * 1e3,
            "swap_gb_s": 2 * nbytes / (t_o + t_i) / 1e9, "d2h_gb_s": nbytes / d2h / 1e9,
            "h2d_gb_s": nbytes / h2d / 1e9, "ratio_vs_plain_copies": (d2h + h2d) / (t_o + t_i),
            "definition": "swap: put (device -> pooled host buffer) + get + load_state (host -> "
                          "device); ratio = (t_d2h + t_h2d) / (t_out + t_in), medians"}


# -- throughput -----------------------------------------------------------------------------------
def gen_tok_s(model: Any, tok: Any, dev: torch.device, batch: int, new: int, reps: int) -> list[float]:
    engine = HFInferenceEngine(copy.deepcopy(model).to(dev), tok)
    prompts = gen_prompts(batch)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=new)
    out = []
    for r in range(reps + 1):  # r = 0 is the warm-up
        dt, gens = clock(lambda r=r: engine.generate(prompts, sampling, seed=r), dev)
        out.append(batch * max(len(g.response_ids) for g in gens) / dt)
    return out[1:]


def step_s(model: Any, dev: torch.device, batch: int, reps: int) -> list[float]:
    tr = make_trainer(model, dev)
    samples = samples_of(model.config.vocab_size, batch)
    scale = 1.0 / token_weight(samples)

    def one() -> None:
        tr.accumulate(samples, scale)
        tr.step()

    return [clock(one, dev)[0] for _ in range(reps + 1)][1:]


def throughput(tok: Any, dev: torch.device, plan: Plan, deadline: float,
               skipped: dict[str, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    same = dev.type == "cpu"
    if same:
        skipped["cpu_figures"] = "--device cpu: the device figures are the CPU figures"
    for preset in plan.presets:
        model = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
        try:
            for kind, batches in (("generate", plan.gen_batches), ("train", plan.train_batches)):
                for b in batches:
                    if time.perf_counter() > deadline:
                        skipped[f"throughput {preset} {kind} batch {b}"] = "past the time budget"
                        continue
                    row = {"preset": preset, "params": num_params(model), "kind": kind, "batch": b}
                    for side, d, reps in (("device", dev, plan.reps), ("cpu", CPU, 1)):
                        if side == "cpu" and (same or b > plan.cpu_max_batch):
                            continue
                        if kind == "generate":
                            t = gen_tok_s(model, tok, d, b, plan.gen_new, reps)
                            row[side] = {"tok_s": max(t), "tok_s_median": statistics.median(t)}
                        else:
                            t = step_s(model, d, b, reps)
                            row[side] = {"step_s": min(t), "step_s_median": statistics.median(t),
                                         "tok_s": b * TRAIN_LEN / min(t)}
                    rows.append(row)
                    print(f"{preset:<9} {kind:<8} batch {b:>4}: " + "  ".join(
                        f"{s} {json.dumps({k: round(v, 4) for k, v in row[s].items()})}"
                        for s in ("device", "cpu") if s in row), flush=True)
        except torch.OutOfMemoryError:
            skipped[f"throughput {preset}"] = "out of device memory: the largest preset that fits is the one before"
            break
        finally:
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# -- team run and scale-out -----------------------------------------------------------------------
#: the real-size team: every agent the small-0.5b preset in bf16, one worker holding one trainer
#: state at a time (the others swapped out), a small batch
REAL_SIZE = [*(f"team.agents.{a}.model={{preset: small-0.5b, dtype: bfloat16}}" for a in ("planner", "solver", "verifier")),
             "batch.inputs_per_iteration=4", "batch.micro_batch_inputs=2", "batch.group_size=4",
             "train.warm_start=none", "train.evaluate=false", "train.evaluate_initial=false",
             "cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}, memory_limit: 60GiB, resident_trainers: 1}]"]


def team_run(plan: Plan, work: Path, dev: torch.device, name: str = "team-run",
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One short `flexmarl train` of configs/tiny.yaml (Prefect flow on a local Dask cluster)
    whose workers build their engines and trainers on `dev` (`cluster.device`); `extra`
    overrides (the real-size team: `REAL_SIZE`, whose swap GB/s it reports)."""
    run_dir = work / name
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"),
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "flexmarl.cli", "train", "configs/tiny.yaml", "--no-progress",
           "--set", f"run_dir={run_dir}", "--set", f"train.iterations={plan.team_iterations}",
           "--set", f"cluster.device={dev}", *(x for o in extra for x in ("--set", o))]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:  # stops the Prefect server only if this run started it (pid file in its PREFECT_HOME)
        subprocess.run([sys.executable, "-m", "flexmarl.cli", "server", "stop"], cwd=REPO, env=env,
                       capture_output=True, timeout=60)
    wall = time.perf_counter() - t0
    log = run_dir / "metrics" / "iterations.jsonl"
    its = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    out: dict[str, Any] = {"passed": proc.returncode == 0 and len(its) == plan.team_iterations,
                           "iterations": len(its), "wall_s": wall, "workers_device": str(dev)}
    if its:
        out.update({k: its[-1][k] for k in ("e2e_s", "tokens", "tokens_per_s", "utilization")})
    ops_log = run_dir / "metrics" / "ops.jsonl"
    ops = [json.loads(line) for line in ops_log.read_text().splitlines() if line.strip()] if ops_log.exists() else []
    for way in ("in", "out"):
        nbytes, secs = (sum(o.get(f"swap_{way}_{k}", 0.0) for o in ops) for k in ("bytes", "s"))
        if nbytes:
            out[f"swap_{way}_gbps"] = nbytes / secs / 1e9
    if not out["passed"]:
        out["error"] = f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}"
    return out


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The names in `names` that do not import here."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def scale_out(tok: Any, plan: Plan, dry: bool, skipped: dict[str, str]) -> dict[str, Any]:
    """vLLM / DeepSpeed rows where they import (bench/engines.py runs them); reasons otherwise."""
    why = {"vllm": "a vLLM GPU wheel is far over the 64 MiB a device run carries",
           "deepspeed": "deepspeed 0.19.8 is published as a source package only, no wheel to carry"}
    have = []
    for name in ("vllm", "deepspeed"):
        if missing_modules((name,)):
            skipped[name] = f"{name} not importable ({why[name]})"
        elif dry:
            skipped[name] = f"--dry-run: {name} on CPU takes minutes; bench/engines.py measures it there"
        else:
            have.append(name)
    if not have:
        return {}
    try:
        return scale_out_rows(list(plan.check_presets[:1]), tok, plan.reps)
    except Exception as e:  # e.g. DeepSpeed DP-2 wants 2 GPUs: the rest of the run stands
        skipped["scale_out"] = f"failed: {type(e).__name__}: {e}"
        return {}


# -- main -----------------------------------------------------------------------------------------
def run_check(checks: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    try:
        row = fn()
    except Exception as e:  # a failed check is a result: the others still run
        row = {"passed": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    checks[name] = row
    print(f"{'PASS' if row['passed'] else 'FAIL'} {name} ({row['seconds']} s)"
          + ("" if row["passed"] else f": {row.get('error', json.dumps(row, default=str)[:600])}"), flush=True)


def environment(dev: torch.device) -> dict[str, Any]:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="fewer presets and batch sizes")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks the script itself")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --dry-run)")
    ap.add_argument("--no-team-run", action="store_true", help="skip the Prefect team run")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--swap-only", action="store_true",
                    help="only the trainer-state swap check, on each checked preset (after a change "
                         "to training/handles.py)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = PLANS["dry" if args.dry_run else "quick" if args.quick else "full"]
    dev = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"bench": "gpu_check", "device": str(dev), "dry_run": args.dry_run,
                              "plan": asdict(plan), "checks": {}, "skipped": {}}
    if dev.type == "cuda" and not torch.cuda.is_available():
        result.update(passed=False, error="no CUDA device visible to torch (use --dry-run to check on CPU)")
        out_path.write_text(json.dumps(result, indent=2))
        print(f"gpu_check: {result['error']}")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    result["env"] = environment(dev)
    checks, skipped = result["checks"], result["skipped"]
    tok = get_tokenizer()
    if args.swap_only:
        for preset in plan.check_presets:
            model = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
            run_check(checks, f"state_swap/{preset}", lambda m=model: check_swap(m, dev, plan))
        return finish(result, out_path, t_start)
    for preset in plan.check_presets:
        model = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
        run_check(checks, f"greedy_cpu_vs_device/{preset}", lambda m=model: check_greedy(m, tok, dev, plan))
        run_check(checks, f"logprobs_engine_vs_trainer/{preset}", lambda m=model: check_logprobs(m, tok, dev, plan))
        for bf16 in (False, True):
            run_check(checks, f"train_step_{'bf16' if bf16 else 'fp32'}/{preset}",
                      lambda m=model, b=bf16: check_train_step(m, dev, plan, bf16=b))
    if missing_modules(("vllm", "peft")):
        skipped["vllm_lora"] = "vllm or peft not importable (vLLM's LoRA path runs where both are installed)"
    else:
        lora_model = build_model(ModelConfig(preset=plan.check_presets[0]), seed=0, tokenizer=tok)
        from bench.gpu_check_lora import check_vllm_lora

        run_check(checks, f"vllm_lora/{plan.check_presets[0]}",
                  lambda: check_vllm_lora(lora_model, tok, dev, plan))
    if missing_modules(ENDPOINT_PACKAGES):
        skipped["endpoint"] = (f"{', '.join(missing_modules(ENDPOINT_PACKAGES))} not importable: carry the "
                               "wheels (bash bench/gpu_check.sh --fetch-wheels team)")
    else:
        from bench.gpu_check_endpoint import check_endpoint

        endpoint_model = build_model(ModelConfig(preset=plan.check_presets[0]), seed=0, tokenizer=tok)
        run_check(checks, f"endpoint/{plan.check_presets[0]}",
                  lambda: check_endpoint(endpoint_model, tok, dev, plan))
    # The swap check after the loop: its model is the largest checked preset's, still bound.
    run_check(checks, f"state_swap/{plan.check_presets[-1]}", lambda m=model: check_swap(m, dev, plan))
    del model
    result["throughput"] = throughput(tok, dev, plan, t_start + plan.budget_s, skipped)
    result["scale_out"] = scale_out(tok, plan, args.dry_run, skipped)
    missing = missing_modules(TEAM_RUN_PACKAGES)
    if args.no_team_run:
        skipped["team_run"] = "--no-team-run"
    elif missing:
        skipped["team_run"] = (f"{', '.join(missing)} not importable: carry the wheels "
                               "(bash bench/gpu_check.sh --fetch-wheels team)")
    else:
        with tempfile.TemporaryDirectory(prefix="flexmarl-gpu-check-") as work:
            run_check(checks, "team_run", lambda: team_run(plan, Path(work), dev))
            if not args.dry_run:  # real-size tokens/s and swap GB/s on the device
                run_check(checks, "team_run/small-0.5b",
                          lambda: team_run(plan, Path(work), dev, "team-run-0.5b", tuple(REAL_SIZE)))
    return finish(result, out_path, t_start)


def finish(result: dict[str, Any], out_path: Path, t_start: float) -> int:
    checks, skipped = result["checks"], result["skipped"]
    result["passed"] = all(c["passed"] for c in checks.values())
    result["wall_s"] = time.perf_counter() - t_start
    out_path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\n{sum(c['passed'] for c in checks.values())}/{len(checks)} checks passed in "
          f"{result['wall_s']:.0f} s; skipped: {', '.join(skipped) or 'nothing'}; wrote {out_path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
