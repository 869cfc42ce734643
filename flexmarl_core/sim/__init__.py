"""The cluster simulator: the real orchestrator and control plane on a virtual clock.

    cfg = load_config("configs/sim/math-3x14b.yaml")
    cluster = load_cluster("configs/sim/paper-48x16.yaml")
    out = simulate(cfg, cost_model(cluster, cfg), *workers(cluster, meg.agent_names))

`Plan`, routing, instance balancing and on-demand allocation run unchanged; `SimExecutor`
(executor.py) advances the clock from one op completion to the next and prices each op with a
`CostModel` (cost.py), either a roofline of a described cluster (cluster.py) or one fitted
from a real run's op log (calibrate.py). Every figure is computed by the same
`metrics.iteration_metrics` a real run uses, and every output is labelled simulated.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flexmarl_core.config import ConfigError, ExperimentConfig
from flexmarl_core.control import Decision, MoveInstance, TrainSlot
from flexmarl_core.driver.metrics import IterationTracker, critical_path, run_summary
from flexmarl_core.meg import MEG
from flexmarl_core.ops import OpRecord, traits
from flexmarl_core.orchestrator.hooks import TrackIterations
from flexmarl_core.orchestrator.loop import Orchestrator
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.sim.cost import CostModel
from flexmarl_core.sim.executor import SimExecutor

LABEL = "simulated"


@dataclass
class SimResult:
    summary: dict[str, Any]
    iterations: list[dict[str, Any]]
    records: list[OpRecord] = field(repr=False)
    decisions: list[Decision] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"label": LABEL, "summary": self.summary, "iterations": self.iterations}


def _timed(fn: Any, acc: list[float], cpu: list[float]) -> Any:
    """`fn`, recording each call's wall seconds in `acc` and its thread's CPU seconds in `cpu`
    (the control plane's decision time; on a loaded machine the wall time also counts the
    time the thread waited for a core)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return wrapper


def _us(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"calls": 0}
    s = sorted(xs)
    return {"calls": len(s), "mean_us": 1e6 * statistics.fmean(s), "p50_us": 1e6 * s[len(s) // 2],
            "p99_us": 1e6 * s[min(int(len(s) * 0.99), len(s) - 1)], "max_us": 1e6 * s[-1]}


def moves_undone(moves: list[MoveInstance], records: list[OpRecord], steady_from: float = 0.0) -> dict[str, int]:
    """Instance moves that a later move of the same worker reversed (`reversed`), and those
    reversed before the worker ran one rollout of the agent it was moved to (`unused`: the
    weights were loaded for nothing). `moves_steady` / `reversed_steady`: the same for the
    moves made from `steady_from` on (after the first iteration, which starts from nothing)."""
    starts: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        if traits(r.op.kind).placement == "instance":
            starts[(r.result.worker, r.op.agent)].append(r.result.t_start)
    by_worker: dict[str, list[MoveInstance]] = defaultdict(list)
    for m in moves:
        by_worker[m.worker].append(m)
    rev = unused = rev_steady = 0
    for ms in by_worker.values():
        for i, m in enumerate(ms):
            back = next((n for n in ms[i + 1:] if n.from_agent == m.to_agent), None)
            if back is None or (m.from_agent is not None and back.to_agent != m.from_agent):
                continue
            rev += 1
            rev_steady += m.t >= steady_from
            unused += not any(m.t <= t < back.t for t in starts[(m.worker, m.to_agent)])
    return {"moves": len(moves), "reversed": rev, "unused": unused,
            "moves_steady": sum(1 for m in moves if m.t >= steady_from), "reversed_steady": rev_steady}


def _longest_path(plan: Plan, records: list[OpRecord]) -> float:
    dur = {r.op: r.result.seconds for r in records}
    done: dict[Any, float] = {}
    for op, deps in plan.deps.items():  # inserted in dependency order
        done[op] = dur.get(op, 0.0) + max((done[d] for d in deps), default=0.0)
    return max(done.values(), default=0.0)


def simulate(cfg: ExperimentConfig, cost: CostModel, workers: dict[str, dict[str, float]],
             pools: dict[str, str] | None = None, *, seed: int | None = None, warm: bool = True) -> SimResult:
    """Run `cfg`'s plan on simulated `workers`; `pools` maps each worker to its device pool
    (utilisation is reported per pool). `seed` (default: the config's) fixes the lengths.
    `warm`: the control plane's estimates start from the cost model's op seconds (else from
    its defaults, as before any warm start existed)."""
    pools = pools or dict.fromkeys(workers, "workers")
    meg = MEG.from_config(cfg.team)
    plan = Plan.build(cfg)
    if plan.critics:
        raise ConfigError(f"the simulator has no cost model for a critic ({sorted(plan.critics)}): simulate "
                          "the team with a critic-free algorithm.advantage (grpo)")
    ex = SimExecutor(cost, workers, cfg, meg, seed=cfg.seed if seed is None else seed)
    rows: list[dict[str, Any]] = []
    tracker = IterationTracker(plan.sizes(), rows.append)
    orch = Orchestrator(plan, cfg, ex, hooks=[TrackIterations(tracker)], sizes=ex.op_sizes() if warm else {},
                        rollout_slots=ex.rollout_slots)
    place_s: list[float] = []
    route_s: list[float] = []
    place_cpu: list[float] = []
    route_cpu: list[float] = []
    orch.control.place = _timed(orch.control.place, place_s, place_cpu)  # type: ignore[method-assign]
    orch.control.route = _timed(orch.control.route, route_s, route_cpu)  # type: ignore[method-assign]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    res = orch.run()
    tracker.flush(final=True)
    cpu = time.process_time() - cpu0
    summary = run_summary(rows, res.wall_s)
    summary.pop("final_accuracy", None)
    summary.pop("final_reward", None)
    span = sum(m["e2e_s"] for m in rows)
    # The first iteration builds engines and trainers and the control plane's duration
    # estimates start from defaults: the steady state is the iterations after it.
    steady = rows[1:] or rows
    steady_s = sum(m["e2e_s"] for m in steady)
    busy: dict[str, float] = defaultdict(float)
    for m in rows:
        for k, v in m.items():
            if k.startswith("busy_s/"):
                busy[pools[k[len("busy_s/"):]]] += v
    size: dict[str, int] = defaultdict(int)
    for p in pools.values():
        size[p] += 1
    moves = [d for d in res.decisions if isinstance(d, MoveInstance)]
    first_end = max((r.result.t_end for r in res.records if r.op.iteration == 0), default=0.0)
    summary.update(
        label=LABEL,
        e2e_s_steady=steady_s / len(steady),
        tokens_per_s_steady=sum(m["tokens"] for m in steady) / steady_s,
        simulated_s=res.wall_s,
        sim_cpu_s=cpu, sim_wall_s=time.perf_counter() - wall0,
        sim_cpu_s_per_iteration=cpu / max(len(rows), 1),
        ops=len(res.records), workers=len(workers),
        utilization_per_pool={p: busy[p] / (span * size[p]) for p in sorted(size)},
        # A perfect packing of this run's busy time in each pool (no dependencies, no idling):
        # no schedule of the same work on the same workers ends sooner.
        ideal_s_per_iteration=max(busy[p] / size[p] for p in size) / max(len(rows), 1),
        # The plan's longest path weighted by these op durations (unlimited workers, no
        # queueing): no schedule of this plan ends sooner either.
        dag_bound_s_per_iteration=_longest_path(plan, res.records) / max(len(rows), 1),
        # Inside a rollout op, a worker's engine replicas decode their share of the
        # micro-batch; the op holds them all until the slowest ends.
        rollout_replica_busy_frac=ex.rollout_replica_busy_s / ex.rollout_held_s if ex.rollout_held_s else 1.0,
        balance_moves=len(moves),
        moves_undone=moves_undone(moves, res.records, steady_from=first_end),
        train_swaps=sum(1 for d in res.decisions if isinstance(d, TrainSlot) and d.swap),
        train_slot_allocations=sum(1 for d in res.decisions if isinstance(d, TrainSlot)),
        control_place=_us(place_s), control_route=_us(route_s),
        control_place_cpu=_us(place_cpu), control_route_cpu=_us(route_cpu),
        balancer_decide=_us([(d.monitor_us + d.decide_us) / 1e6 for d in moves]),
        critical_path=critical_path(res.records, plan.deps),
    )
    iterations = [{k: v for k, v in m.items() if not k.startswith("busy_s/") and k != "accuracy"} for m in rows]
    return SimResult(summary=summary, iterations=iterations, records=res.records, decisions=res.decisions)
