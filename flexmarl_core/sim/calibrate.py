"""Fit the cost model from a finished run's op log (`RUN/metrics/ops.jsonl` + `RUN/config.yaml`).

Every figure of the fitted model is measured in that run (labelled `measured: RUN ...`)
except the response-length spread and the weight-load bandwidth, which the log cannot show
(labelled `assumption`). Per agent, from the ops that found their engine / trainer already
built on their worker ("warm"):

    rollout  step_seq_s  = mean seconds / (sequences x decode steps); HF generate runs every
                           row to max_new_tokens' worth of steps unless all stop (static batch)
    train    train_token_s = sum seconds / sum loss tokens
    step     step_s      = mean seconds - checkpoint at the measured swap bandwidth
    sync     sync_gbps   = published bytes / seconds
    init     engine_init_s / trainer_init_s = mean excess of an agent's first op on a worker

plus dispatch (ready to start on an idle worker), gap (between queued ops on one worker) and
report (end to the orchestrator seeing it) latencies as medians over the run.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from flexmarl_core.config import ConfigError, ExperimentConfig, load_config
from flexmarl_core.ops import Op
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.runfiles.location import CONFIG_NAME
from flexmarl_core.sim.cost import AgentCost, CostModel, LengthDist

#: log-sigma of response lengths (the op log has per-op means only)
LENGTH_SIGMA = 0.3


class CalibrationError(ConfigError):
    """A run folder whose op log cannot be fitted; the message names the file and why."""


def load_run(run: str | Path) -> tuple[ExperimentConfig, list[dict[str, Any]]]:
    run = Path(run)
    cfg_path, log = run / CONFIG_NAME, run / "metrics" / "ops.jsonl"
    for p in (cfg_path, log):
        if not p.is_file():
            raise CalibrationError(f"--calibrate {run}: no {p.relative_to(run)} (not a finished flexmarl run folder)")
    cfg = load_config(cfg_path)
    rows = []
    for i, line in enumerate(log.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{log}:{i}: not a JSON op row ({exc.msg})") from None
    if not rows:
        raise CalibrationError(f"{log}: no ops recorded")
    missing = {k for k in ("kind", "t_start", "t_end", "submitted", "finished", "worker") if k not in rows[0]}
    if missing:
        raise CalibrationError(f"{log}: op rows lack {sorted(missing)}")
    old = next((i for i, r in enumerate(rows, 1) if r["kind"] in ("rollout", "train") and "tokens" not in r), None)
    if old is not None:
        raise CalibrationError(f"{log}:{old}: a {rows[old - 1]['kind']} row without `tokens` (an op log of an "
                               "earlier flexmarl version): record the run again to calibrate from it")
    return cfg, rows


def _fit_mean(target: float, sigma: float, cap: int) -> float:
    """The uncapped lognormal mean whose capped draws average `target` (bisection)."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal(20000)

    def capped(m: float) -> float:
        return float(np.clip(np.rint(np.exp(np.log(m) - sigma**2 / 2 + sigma * z)), 1, cap).mean())

    lo, hi = 1.0, 50.0 * cap
    if target >= capped(hi):
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _op(r: dict[str, Any]) -> Op:
    return Op(r["iteration"], r["kind"], r.get("agent", ""), r.get("turn", 0), r.get("mb", -1))


def latencies(cfg: ExperimentConfig, rows: list[dict[str, Any]]) -> dict[str, float]:
    """dispatch_s: ready (last dependency seen finished) to start, for ops whose worker was
    idle then; gap_s: previous end to start on a worker that had the op queued; report_s."""
    deps = Plan.build(cfg).deps
    by_op = {_op(r): r for r in rows}
    t0 = min(r["submitted"] for r in rows)
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_worker[r["worker"]].append(r)
    dispatch, gap = [], []
    for ops in by_worker.values():
        ops.sort(key=lambda r: r["t_start"])
        for prev, r in zip([None, *ops[:-1]], ops, strict=True):
            ready = max((by_op[d]["finished"] for d in deps.get(_op(r), []) if d in by_op), default=t0)
            if prev is None or prev["t_end"] <= ready:
                dispatch.append(r["t_start"] - ready)
            else:
                gap.append(r["t_start"] - prev["t_end"])
    report = [r["finished"] - r["t_end"] for r in rows]
    med = statistics.median
    return {"dispatch_s": max(med(dispatch), 0.0) if dispatch else 0.0,
            "gap_s": max(med(gap), 0.0) if gap else 0.0, "report_s": max(med(report), 0.0)}


def fit(cfg: ExperimentConfig, rows: list[dict[str, Any]], source: str = "the op log") -> CostModel:
    """The cost model of the run whose config and op rows are given."""
    seen: set[tuple[str, str, str]] = set()
    warm: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    first: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["t_start"]):
        role = "engine" if r["kind"] == "rollout" else "trainer" if r["kind"] in ("train", "step", "sync") else ""
        key = (role, r.get("agent", ""), r["worker"])
        if role and key not in seen:
            seen.add(key)
            first[(r["kind"], r.get("agent", ""))].append(r)
        else:
            warm[(r["kind"], r.get("agent", ""))].append(r)
    for k, v in first.items():  # an agent's only ops of a kind were all first ones: use them
        if not warm.get(k):
            warm[k] = v

    def secs(r: dict[str, Any]) -> float:
        return r["t_end"] - r["t_start"] - r.get("swap_in_s", 0.0)

    swaps = [(r.get(f"swap_{d}_bytes", 0.0), r.get(f"swap_{d}_s", 0.0)) for r in rows for d in ("in", "out")]
    swap_b, swap_s = sum(b for b, _ in swaps), sum(s for _, s in swaps)
    swap_gbps = swap_b / swap_s / 1e9 if swap_s > 0 else 1.0
    syncs = [r for r in rows if r["kind"] == "sync" and r.get("bytes")]
    sync_gbps = (sum(r["bytes"] for r in syncs) / max(sum(secs(r) for r in syncs), 1e-9) / 1e9) if syncs else 1.0

    agents: dict[str, AgentCost] = {}
    for a in cfg.team.agents:
        name, cap = a.name, a.sampling.max_new_tokens
        ro = warm.get(("rollout", name), [])
        if not ro:
            raise CalibrationError(f"{source}: no rollout ops of agent {name!r} to fit")
        per_seq = sum(r["tokens"] for r in ro) / max(sum(r["samples"] for r in ro), 1)
        steps_seqs = sum(r["samples"] * cap for r in ro)
        tr = warm.get(("train", name), [])
        st = warm.get(("step", name), [])
        state_bytes = statistics.mean(r.get("swap_out_bytes", 0.0) for r in st) if st else 0.0
        weight_bytes = statistics.mean(r["bytes"] for r in syncs if r["agent"] == name) if syncs else 0.0
        ac = AgentCost(
            prompt_tokens=0, lengths=LengthDist(_fit_mean(per_seq, LENGTH_SIGMA, cap), LENGTH_SIGMA, cap),
            weight_bytes=weight_bytes, state_bytes=state_bytes,
            batching="static" if a.backend.inference == "hf" else "continuous",
            step_seq_s=sum(secs(r) for r in ro) / steps_seqs,
            train_token_s=(sum(secs(r) for r in tr) / max(sum(r["tokens"] for r in tr), 1)) if tr else 0.0,
            train_prompt_weight=0.0,
            step_s=max(statistics.mean(secs(r) for r in st) - state_bytes / (swap_gbps * 1e9), 0.0) if st else 0.0,
        )
        # What an agent's first op on a worker took beyond its warm prediction.
        eng = [secs(r) - ac.step_seq_s * r["samples"] * cap for r in first.get(("rollout", name), [])]
        trn = [secs(r) - ac.train_token_s * r["tokens"] for r in first.get(("train", name), [])]
        ac.engine_init_s = max(statistics.mean(eng), 0.0) if eng else 0.0
        ac.trainer_init_s = max(statistics.mean(trn), 0.0) if trn else 0.0
        agents[name] = ac
    rewards = [r for r in rows if r["kind"] == "reward"]
    lat = latencies(cfg, rows)
    model = CostModel(
        agents=agents, **lat,
        reward_sample_s=sum(secs(r) for r in rewards) / max(sum(r["samples"] for r in rewards), 1),
        load_gbps=sync_gbps, swap_gbps=swap_gbps, sync_gbps=sync_gbps,
    )
    m = f"measured: {source}"
    model.sources = {
        "rollout.step_seq_s": f"{m}, warm rollouts (seconds / sequences / max_new_tokens)",
        "train.train_token_s": f"{m}, warm train ops (seconds / loss tokens)",
        "step.step_s": f"{m}, step ops less the checkpoint",
        "engine_init_s / trainer_init_s": f"{m}, first op of an agent on a worker",
        "swap_gbps": f"{m}, swap_in/swap_out bytes over seconds",
        "sync_gbps": f"{m}, published weight bytes over sync seconds",
        "reward_sample_s": f"{m}, reward ops",
        "dispatch_s / gap_s / report_s": f"{m}, medians of op start/end vs readiness",
        "lengths.mean": f"{m}, mean response tokens per sequence (capped lognormal fitted to it)",
        "lengths.sigma": f"assumption: {LENGTH_SIGMA} (the op log has per-op means only)",
        "load_gbps": "assumption: equal to the measured sync bandwidth (same file tier)",
    }
    return model


def calibrate(run: str | Path) -> tuple[ExperimentConfig, CostModel, list[dict[str, Any]]]:
    """`flexmarl simulate --calibrate RUN`: the run's config, its fitted model and its rows."""
    cfg, rows = load_run(run)
    return cfg, fit(cfg, rows, source=str(run)), rows


def measured_summary(rows: list[dict[str, Any]], iterations: int) -> dict[str, float]:
    """E2E per iteration and tokens/s of the recorded run, by the same windows as
    `metrics.iteration_metrics` (first op's start to each iteration's last end)."""
    ends: dict[int, float] = defaultdict(float)
    for r in rows:
        ends[r["iteration"]] = max(ends[r["iteration"]], r["t_end"])
    start = min(r["t_start"] for r in rows)
    span = max(ends.values()) - start
    tokens = sum(r["tokens"] for r in rows if r["kind"] == "rollout")
    return {"e2e_s_per_iteration": span / iterations, "tokens_per_s": tokens / span}
