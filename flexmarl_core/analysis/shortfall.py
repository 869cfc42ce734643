"""Why a wall-time speedup falls short of `speedup_bound`, measured (`bench/e2e.py` reports it).

    speedup ~ speedup_bound x ops_ratio x floor_frac_codesign

(exact for one repeat whose floors are both the work term, not the dependency chain; the
bench's figures are medians over repeats, so the product comes within about 1%).
`speedup_bound` packs the *sync run's* op durations on the co-design's graph; `ops_ratio`
(`stage_time_ratio_sync_over_codesign`) is how long the same ops took in the sync run over the
co-design run; `floor_frac_codesign` is how close the co-design's schedule came to the best one
of its own ops. The schedule owns the last factor. The middle one is mostly not the schedule's:
the co-design keeps both cores busy and the sync run about one, and two busy cores of a VM do
not each run as fast as one (shared cache and memory bandwidth, the host's other tenants). This
module measures that machine property directly, and the one cost the co-design adds to an op
(a gradient helper's weights load and gradient file), so the report can say which is which.

`bench/shortfall.py --json OUT [--quick]` measures the parallel efficiency alone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from flexmarl_core.analysis.bound import op_log
from flexmarl_core.models.factory import preset_config
from flexmarl_core.models.tokenizer import get_tokenizer


def _steps(preset: str, steps: int, start, out) -> None:  # noqa: ANN001 (multiprocessing handles)
    """One worker's kind of work: forward + backward of `preset` at one torch thread."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(preset_config(preset, get_tokenizer()))
    x = torch.randint(0, model.config.vocab_size, (8, 96))
    model(x, labels=x).loss.backward()  # warm: allocator and kernels
    start.wait()
    t = time.perf_counter()
    for _ in range(steps):
        model(x, labels=x).loss.backward()
    out.put(time.perf_counter() - t)


def _timed(k: int, preset: str, steps: int) -> list[float]:
    # A fresh interpreter per probe process, never a fork of this one (it holds Dask and
    # Prefect threads), nor the workers' forkserver: the first to start that one sets the
    # environment every later worker forks from (Dask's pre-spawn settings among it).
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_steps, args=(preset, steps, start, out)) for _ in range(k)]
    for p in procs:
        p.start()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return times


def parallel_efficiency(preset: str = "tiny-10m", steps: int = 6, rounds: int = 2) -> dict:
    """How fast each of two processes runs `steps` of the workers' work with both cores busy,
    relative to one process alone (1.0: no slowdown), alternating alone / together per round.
    The VM's figure drifts within minutes (0.85-1.03 in one series here), so `bench/e2e.py`
    measures it before its first run and after its last."""
    per_round = []
    for _ in range(rounds):
        alone = _timed(1, preset, steps)[0]
        two = _timed(2, preset, steps)
        per_round.append(alone / statistics.mean(two))
    return {"preset": preset, "steps": steps, "per_round": per_round, "median": statistics.median(per_round)}


def helper_cost(run_dirs: list[Path]) -> dict:
    """What gradient helpers add to an op, from co-design runs' op logs (summed over
    `run_dirs`, since one run holds a handful of helper ops of different sizes): per agent, the
    CPU seconds per trained token of its helper train ops over its trainer's own
    (`token_cost`, 1.0 = nothing extra), and the CPU the helpers spent beyond their tokens at
    the trainer's own rate, as a share of all the runs' stage CPU (`excess_frac`)."""
    cost: dict[tuple[str, bool], list[float]] = {}
    stage_cpu = 0.0
    for run_dir in run_dirs:
        decisions = (Path(run_dir) / "metrics" / "decisions.jsonl").read_text().splitlines()
        helped = {(d["agent"], d["iteration"], d["mb"]) for d in map(json.loads, decisions)
                  if d.get("decision") == "gradient_helper"}
        for o in op_log(run_dir):
            stage_cpu += o["cpu_s"]
            if o["kind"] != "train" or o.get("skipped") or not o.get("tokens"):
                continue
            c = cost.setdefault((o["agent"], (o["agent"], o["iteration"], o["mb"]) in helped), [0.0, 0.0])
            c[0] += o["cpu_s"]
            c[1] += o["tokens"]
    token_cost, excess = {}, 0.0
    for (agent, is_helper), (cpu, tokens) in cost.items():
        own = cost.get((agent, False))
        if is_helper and own and own[1]:
            rate = own[0] / own[1]
            token_cost[agent] = (cpu / tokens) / rate
            excess += cpu - tokens * rate
    return {"token_cost": token_cost, "excess_frac": excess / stage_cpu if stage_cpu else 0.0}


def decompose(res: dict, before: dict | None, after: dict | None, helpers: dict) -> dict:
    """What explains the ops ratio of `bench/e2e.py`'s result `res` (whose own keys hold the
    three factors), and the ceiling that this machine's measured parallel efficiency puts on a
    schedule that keeps both cores busy."""
    out = {
        "helper_token_cost": helpers.get("token_cost", {}),
        "helper_excess_frac": helpers.get("excess_frac", 0.0),
    }
    effs = [e["median"] for e in (before, after) if e]
    if effs:
        eff = statistics.mean(effs)
        out["parallel_efficiency"] = {"before": before, "after": after, "mean": eff}
        # Every op of a schedule that keeps both cores busy runs at `eff` of its speed alone,
        # so no such schedule ends sooner than the bound's floor / eff.
        out["speedup_ceiling_machine"] = res["speedup_bound"] * eff
        out["speedup_frac_of_machine_ceiling"] = res["speedup"] / out["speedup_ceiling_machine"]
    return out
