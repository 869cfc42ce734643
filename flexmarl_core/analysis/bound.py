"""What a schedule of one run's measured ops could do at best, from that run's own op log.

`bench/e2e.py` reports these for its runs; `bench/bound.py RUN_DIR ...` reads finished run
folders, so a bench's runs can be analysed again after a change here.

For a run with op durations d (t_end - t_start, as its workers measured them) on W one-op-at-a-
time workers, under the co-design's dependencies (`Plan` with every switch on: the loosest
graph the switches allow, so a floor for every mode's schedule):

* `work_floor_s` = sum(d) / W: no idle time at all;
* `chain_floor_s`: the longest chain of dependencies. An agent's train ops of one iteration
  may overlap on this graph (gradient helpers compute a micro-batch's gradient on another
  worker), so only its step waits for the last of them; `chain_floor(..., trainer_serial=True)`
  is the chain where they run one at a time in its trainer's process (the single-machine
  makespan of its train ops with their release times, earliest release first);
* `floor_s` = max of the two: no schedule of these ops on W workers ends sooner (it relaxes
  placement, swaps and dispatch, never the work or the dependencies);
* `list_s`: a greedy schedule of the same ops on W workers (critical-path priority, the
  dependencies kept, an agent's trainer ops one at a time), an achievable E2E for a scheduler
  that knew every duration in advance, so the truth lies between `floor_s` and `list_s`;
* `best_list_s`: the shortest of a few hundred greedy schedules with perturbed priorities,
  with the floor's own relaxations (any op on any worker, free dispatch, train ops overlapping
  at their measured cost): whether the floor is within reach of an order at all, for a
  scheduler that knew every duration in advance and placed ops freely.

The floor is per run, so the ratio `floor_s / e2e` of a run does not depend on how loaded the
machine was during some other run (the old `speedup_bound` divided the sync run's wall time by
the co-design run's stage time, so load that changed between the two runs moved it: 2.75 with
2 workers). Against a baseline, `speedup_bound` = baseline E2E / the floor of the baseline's own
ops on the co-design's graph: at most 1 / the baseline's utilisation while the chain does not
bind, which exceeds W only where the baseline idles more than (W-1)/W of the time.

`idle_causes`: each worker's idle time inside the run, split by what the others were running
meanwhile (`train[solver]`: idle while another worker trained the solver; `none`: every worker
idle, i.e. dispatch and bookkeeping gaps).
"""

from __future__ import annotations

import heapq
import json
import random
from collections import defaultdict
from pathlib import Path

from flexmarl_core.config import SWITCHES, load_config, switch_overrides
from flexmarl_core.driver.metrics import IterationTracker, run_summary
from flexmarl_core.meg import MEG
from flexmarl_core.ops import Op, on_trainer, traits
from flexmarl_core.orchestrator.hooks import TrackIterations
from flexmarl_core.orchestrator.loop import Orchestrator
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.sim.cost import AgentCost, CostModel, LengthDist
from flexmarl_core.sim.executor import SimExecutor


def op_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics" / "ops.jsonl").read_text().splitlines()]


def durations(rows: list[dict], clock: str = "wall") -> dict[Op, float]:
    """Each op's seconds: `wall` (t_end - t_start) or `cpu` (the CPU its worker process used
    for it: what it takes with a core to itself, whatever else loaded the machine)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', not {clock!r}")
    return {Op(r["iteration"], r["kind"], r["agent"], r["turn"], r["mb"]):
            r["t_end"] - r["t_start"] if clock == "wall" else r["cpu_s"] for r in rows}


def longest_first(d: dict[Op, float], agent: str) -> dict[Op, float]:
    """`d` with each iteration's micro-batches renumbered so that mb 0 is the one whose
    `agent` rollouts took longest, mb 1 the next, ...: the same work, started longest first (a
    classic makespan heuristic), with the measured costs as a perfect predictor of them."""
    cost: dict[int, dict[int, float]] = {}
    for op, s in d.items():
        if traits(op.kind).generates and op.agent == agent and op.mb >= 0:
            cost.setdefault(op.iteration, {}).setdefault(op.mb, 0.0)
            cost[op.iteration][op.mb] += s
    new = {it: {mb: rank for rank, (mb, _) in enumerate(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))}
           for it, c in cost.items()}
    return {(Op(op.iteration, op.kind, op.agent, op.turn, new[op.iteration][op.mb])
             if op.mb >= 0 and op.iteration in new else op): s for op, s in d.items()}


def codesign_deps(run_dir: Path) -> dict[Op, list[Op]]:
    """The run's plan with every co-design switch on (its staleness as it was)."""
    cfg = load_config(Path(run_dir) / "config.yaml", switch_overrides(on=SWITCHES))
    return Plan.build(cfg).deps


def _topo(deps: dict[Op, list[Op]]) -> list[Op]:
    order, seen = [], set()
    for root in deps:
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if expanded:
                order.append(op)
                continue
            if op in seen:
                continue
            seen.add(op)
            stack.append((op, True))
            stack.extend((d, False) for d in deps.get(op, []) if d not in seen)
    return order


def chain_floor(deps: dict[Op, list[Op]], d: dict[Op, float], trainer_serial: bool = True) -> float:
    """Longest dependency chain; with `trainer_serial`, an agent's train ops of an iteration
    one at a time (without: they may overlap, as gradient helpers let them, and its step
    waits for the last)."""
    finish: dict[Op, float] = {}
    release: dict[Op, float] = {}
    for op in _topo(deps):
        ready = max((finish[p] for p in deps.get(op, [])), default=0.0)
        if trainer_serial and traits(op.kind).steps:
            # 1 | r_j | Cmax: process the train ops in release order.
            t = 0.0
            for tr in sorted(deps[op], key=lambda o: release[o]):
                t = max(t, release[tr]) + d.get(tr, 0.0)
            ready = max(ready, t)
        release[op] = ready
        finish[op] = ready + d.get(op, 0.0)
    return max(finish.values(), default=0.0)


def _levels(deps: dict[Op, list[Op]], d: dict[Op, float]) -> tuple[dict[Op, float], dict[Op, list[Op]]]:
    children: dict[Op, list[Op]] = defaultdict(list)
    for op, ps in deps.items():
        for p in ps:
            children[p].append(op)
    level: dict[Op, float] = {}
    for op in reversed(_topo(deps)):
        level[op] = d.get(op, 0.0) + max((level[c] for c in children[op]), default=0.0)
    return level, children


def list_schedule(deps: dict[Op, list[Op]], d: dict[Op, float], workers: int,
                  priority: dict[Op, float] | None = None, trainer_serial: bool = True,
                  _graph: tuple[dict[Op, float], dict[Op, list[Op]]] | None = None) -> float:
    """Makespan of a greedy schedule on `workers` workers: a free worker takes the ready op with
    the highest `priority` (default: the longest remaining chain, its bottom level); with
    `trainer_serial`, an agent's trainer ops wait for its last one (without: train ops of one
    agent may run at once, as gradient helpers let them; its step still waits for them all)."""
    level, children = _graph or _levels(deps, d)
    prio = level if priority is None else priority
    serial = on_trainer if trainer_serial else (lambda kind: on_trainer(kind) and not traits(kind).trains)
    waiting = {op: len(ps) for op, ps in deps.items()}
    ready = [(-prio[op], op) for op, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    free_at = [0.0] * workers
    running: list[tuple[float, Op]] = []  # (end, op)
    trainer_free: dict[str, float] = defaultdict(float)
    now, end = 0.0, 0.0
    while ready or running:
        held = []
        while ready and any(f <= now for f in free_at):
            neg, op = heapq.heappop(ready)
            if serial(op.kind) and trainer_free[op.agent] > now:
                held.append((neg, op))
                continue
            w = min(range(workers), key=lambda i: free_at[i])
            t_end = now + d.get(op, 0.0)
            free_at[w] = t_end
            if serial(op.kind):
                trainer_free[op.agent] = t_end
            heapq.heappush(running, (t_end, op))
        for item in held:
            heapq.heappush(ready, item)
        if not running:
            now = min(trainer_free.values())  # pragma: no cover - a held trainer op, nothing running
            continue
        now, op = heapq.heappop(running)
        end = max(end, now)
        for c in children[op]:
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, (-prio[c], c))
    return end


def best_list_schedule(deps: dict[Op, list[Op]], d: dict[Op, float], workers: int, tries: int = 300,
                       trainer_serial: bool = False, seed: int = 0) -> float:
    """The shortest makespan found over `tries` greedy schedules whose priorities are the bottom
    levels perturbed at random (up to +-50%), the unperturbed one included: an achievable E2E
    for a scheduler that knew every duration in advance and searched for its order, with the
    floor's relaxations (any op on any worker, no dispatch or placement cost; without
    `trainer_serial`, an agent's train ops overlap at their measured cost, as gradient helpers
    let them). So the best schedule of these ops lies between `chain_floor` / the work floor
    (with the same `trainer_serial`) and this."""
    rng = random.Random(seed)
    graph = _levels(deps, d)
    level = graph[0]
    best = list_schedule(deps, d, workers, level, trainer_serial, graph)
    for i in range(tries):
        eps = 0.5 * (i + 1) / tries
        prio = {op: lv * (1.0 + rng.uniform(-eps, eps)) for op, lv in level.items()}
        best = min(best, list_schedule(deps, d, workers, prio, trainer_serial, graph))
    return best


def replay(run_dir: Path, overrides: list[str], dispatch_s: float = 0.02, clock: str = "wall",
           longest_first_by: str | None = None) -> dict:
    """The real orchestrator and control plane (`sim.SimExecutor`'s virtual clock) on the
    run's measured op durations, under the run's config plus `overrides` (e.g. another
    switch): E2E and utilisation without machine noise, so two policies compare exactly.
    Durations stay as measured wherever an op runs (swaps and engine loads included).
    `longest_first_by`: an agent; its longest micro-batches first (`longest_first`)."""
    d = durations(op_log(run_dir), clock)
    if longest_first_by is not None:
        d = longest_first(d, longest_first_by)
    cfg = load_config(Path(run_dir) / "config.yaml", overrides)
    meg = MEG.from_config(cfg.team)

    class Replay(SimExecutor):
        def _base_s(self, op: Op) -> float:
            return d[op]

        def _prepare(self, op: Op, worker: str) -> tuple[float, dict[str, float]]:
            return 0.0, {}

        _helper_s = _prepare

    one = AgentCost(prompt_tokens=1, lengths=LengthDist(1, 0, 1), weight_bytes=0, state_bytes=0)
    cost = CostModel(agents=dict.fromkeys(meg.agent_names, one), dispatch_s=dispatch_s)
    workers = {w.name: dict(w.resources) for w in cfg.cluster.workers}
    plan = Plan.build(cfg)
    ex = Replay(cost, workers, cfg, meg)
    rows: list[dict] = []
    tracker = IterationTracker(plan.sizes(), rows.append, lambda: len(workers))
    res = Orchestrator(plan, cfg, ex, hooks=[TrackIterations(tracker)]).run()
    tracker.flush(final=True)
    s = run_summary(rows, res.wall_s)
    ops = [{"kind": r.op.kind, "agent": r.op.agent, "worker": r.result.worker, "t_start": r.result.t_start,
            "t_end": r.result.t_end, "iteration": r.op.iteration, "mb": r.op.mb} for r in res.records]
    return {"e2e_s": sum(m["e2e_s"] for m in rows), "utilization": s["utilization"],
            "idle_causes": idle_causes(ops), "ops": ops}


def cpu_replay(run_dir: Path, workers: int = 2, overrides: tuple[str, ...] = ()) -> dict:
    """Both modes replayed on one run's ops at their CPU seconds (as if each op had a core to
    itself: on a machine other jobs load, wall times measure the share of CPU a process got,
    and two busy workers take it from each other, which a one-worker phase does not):
    the co-design as configured and the synchronous baseline (every switch off), their E2E,
    speedup and utilisation, and the co-design's floor on the same durations. `overrides`
    apply to the co-design (e.g. `codesign.late_binding=true`)."""
    cd = replay(run_dir, [*switch_overrides(on=SWITCHES), *overrides], clock="cpu")
    sy = replay(run_dir, switch_overrides(off=SWITCHES), clock="cpu")
    d = durations(op_log(run_dir), "cpu")
    deps = codesign_deps(run_dir)
    floor = max(sum(d.values()) / workers, chain_floor(deps, d, trainer_serial=False))
    return {"e2e_s_codesign": cd["e2e_s"], "e2e_s_sync": sy["e2e_s"], "speedup": sy["e2e_s"] / cd["e2e_s"],
            "util_codesign": cd["utilization"], "util_sync": sy["utilization"], "floor_s": floor,
            "floor_frac_codesign": floor / cd["e2e_s"], "speedup_bound": sy["e2e_s"] / floor,
            "idle_causes_codesign": cd["idle_causes"]}


def idle_causes(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per worker, seconds idle inside the run's span, by what the other workers ran then."""
    t0, t1 = min(r["t_start"] for r in rows), max(r["t_end"] for r in rows)
    by_w: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for r in rows:
        label = f"{r['kind']}[{r['agent']}]" if r["agent"] else r["kind"]
        by_w[r["worker"]].append((r["t_start"], r["t_end"], label))
    # Elementary intervals between every boundary: in each, who is busy with what.
    cuts = sorted({t0, t1, *(t for iv in by_w.values() for s, e, _ in iv for t in (s, e))})
    out: dict[str, dict[str, float]] = {w: defaultdict(float) for w in by_w}
    for a, b in zip(cuts, cuts[1:], strict=False):
        mid = (a + b) / 2
        doing = {w: next((lab for s, e, lab in iv if s <= mid < e), None) for w, iv in by_w.items()}
        for w, lab in doing.items():
            if lab is None:
                others = sorted({x for v, x in doing.items() if v != w and x is not None})
                out[w][" + ".join(others) or "none"] += b - a
    return {w: dict(sorted(c.items(), key=lambda kv: -kv[1])) for w, c in sorted(out.items())}


def analyse(run_dir: Path, workers: int = 2, durations_from: Path | None = None, search: bool = True) -> dict:
    """Floors and a list schedule for `run_dir`'s graph (co-design switches) with the op
    durations of `durations_from` (default: the run itself), and the run's own E2E; with
    `search`, the best schedule a search finds too (`best_list_s`, and `best_list_serial_s` with
    an agent's train ops one at a time; the searches take seconds)."""
    rows = op_log(run_dir)
    d = durations(op_log(durations_from) if durations_from else rows)
    deps = codesign_deps(run_dir)
    missing = sorted(op.name for op in deps if op not in d)
    if missing:
        raise ValueError(f"{durations_from or run_dir}: no measured duration for {missing[:3]} "
                         f"({len(missing)} ops); the two runs must run the same plan")
    its = [json.loads(line) for line in (Path(run_dir) / "metrics" / "iterations.jsonl").read_text().splitlines()]
    e2e = sum(m["e2e_s"] for m in its)
    work = sum(d.values()) / workers
    chain = chain_floor(deps, d, trainer_serial=False)
    floor = max(work, chain)
    return {"e2e_s": e2e, "work_floor_s": work, "chain_floor_s": chain, "floor_s": floor,
            "list_s": list_schedule(deps, d, workers),
            "best_list_s": best_list_schedule(deps, d, workers) if search else None,
            "best_list_serial_s": best_list_schedule(deps, d, workers, trainer_serial=True) if search else None,
            "floor_frac": floor / e2e,
            "idle_causes": idle_causes(rows)}
