"""The iteration graph and the event loop: dependencies per co-design switch, routing, the
one-op-per-trainer rule. Runs the real orchestrator on the in-process ThreadExecutor."""

from __future__ import annotations

import threading
import time

import pytest

from flexmarl_core.config import config_from_dict
from flexmarl_core.control import MoveInstance, Router, TrainSlot
from flexmarl_core.ops import Op, StageResult
from flexmarl_core.orchestrator.hooks import Callbacks
from flexmarl_core.orchestrator.loop import Orchestrator, OrchestratorError
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.sim.threads import ThreadExecutor

TEAM = {
    "agents": [
        {"name": "planner", "template": "{input}"},
        {"name": "solver", "template": "{input} {planner}"},
        {"name": "verifier", "template": "{input} {solver}"},
    ],
    "edges": ["planner -> solver", "solver -> verifier"],
}
WORKERS = {"w0": {"rollout": 1, "train": 1}, "w1": {"rollout": 1, "train": 1}}
ALL_OFF = {"dependency_parallel": False, "load_balancing": False, "async_pipeline": False,
           "on_demand_allocation": False}


def cfg_of(codesign: dict, iterations: int = 2, mbs: int = 2):
    return config_from_dict({
        "team": TEAM, "codesign": codesign, "train": {"iterations": iterations},
        "batch": {"inputs_per_iteration": 2 * mbs, "micro_batch_inputs": 2},
    })


#: how long a held stage waits for what it is held for; past it the stage goes on and the
#: test's assertion on what should have happened meanwhile fails (it never hangs)
HOLD_LIMIT_S = 60.0


class Seen:
    """What the threaded run has done so far, for holds: ops submitted (`RecordingExecutor`),
    ops started, and each started op's worker and whether it ran as a gradient helper."""

    def __init__(self) -> None:
        self.submitted: set[Op] = set()
        self.started: dict[Op, str] = {}
        self.helpers: set[Op] = set()
        self.changed = threading.Condition()

    def note(self, update) -> None:
        with self.changed:
            update()
            self.changed.notify_all()

    def wait(self, until) -> bool:
        """Block until `until(self)` holds (True), or `HOLD_LIMIT_S` passes (False)."""
        with self.changed:
            return self.changed.wait_for(lambda: until(self), timeout=HOLD_LIMIT_S)


class RecordingExecutor(ThreadExecutor):
    def __init__(self, fn, workers, seen: Seen) -> None:
        super().__init__(fn, workers)
        self.seen = seen

    def submit(self, op, route, deps=(), after=()):
        handle = super().submit(op, route, deps, after)
        self.seen.note(lambda: self.seen.submitted.add(op))
        return handle

    def submit_fused(self, ops, route, deps=(), after=()):
        handle = super().submit_fused(ops, route, deps, after)
        self.seen.note(lambda: self.seen.submitted.update(ops))
        return handle


def run(cfg, workers=WORKERS, delay=lambda op: 0.01, helpers: list[Op] | None = None, holds=None):
    """The orchestrator on threads with stages that sleep `delay(op)`; the log of (op, worker,
    start, end). `helpers`: collects the ops run as gradient helpers. `holds`: {op: until}, an
    op held at its start until `until(seen)` is true of the run so far (`Seen`); the ops whose
    hold came true are `res.released`, so a test asserts what its holds waited for."""
    log: list[tuple[Op, str, float, float]] = []
    lock = threading.Lock()
    seen = Seen()
    holds = holds or {}
    released: list[Op] = []

    def fn(op: Op, worker: str, gradient_only: bool = False) -> StageResult:
        t0 = time.time()

        def started() -> None:
            seen.started[op] = worker
            if gradient_only:
                seen.helpers.add(op)

        seen.note(started)
        if op in holds and seen.wait(holds[op]):
            released.append(op)
        time.sleep(delay(op))
        with lock:
            log.append((op, worker, t0, time.time()))
            if gradient_only and helpers is not None:
                helpers.append(op)
        return StageResult(op, worker=worker, t_start=t0, t_end=time.time())

    ex = RecordingExecutor(fn, workers, seen)
    try:
        res = Orchestrator(Plan.build(cfg, window=1), cfg, ex).run()  # as a run builds it
    finally:
        ex.close()
    res.released = released
    return res, log


def start(log, op):
    return next(t0 for o, _, t0, _ in log if o == op)


def end(log, op):
    return next(t1 for o, _, _, t1 in log if o == op)


def test_plan_counts_and_names():
    cfg = cfg_of(ALL_OFF, iterations=3, mbs=2)
    plan = Plan.build(cfg)
    assert plan.count("rollout") == 3 * 3 * 2
    assert plan.count("reward") == 3 * 2
    assert plan.count("train") == 3 * 3 * 2 and plan.count("step") == 9 and plan.count("sync") == 9
    assert Op(3, "rollout", "solver", 0, 2).name == "rollout[solver] it=3 mb=2"
    assert Op(1, "step", "planner").name == "step[planner] it=1"


def test_every_op_runs_once_and_after_its_deps():
    for codesign in (ALL_OFF, {}):
        cfg = cfg_of(codesign)
        res, log = run(cfg)
        plan = Plan.build(cfg)
        assert sorted(o for o, *_ in log) == sorted(plan.ops())
        for op, deps in plan.deps.items():
            for d in deps:
                assert end(log, d) <= start(log, op), (d.name, op.name)
        assert len(res.records) == len(plan.ops())


def test_sync_baseline_is_phased():
    cfg = cfg_of(ALL_OFF)
    _, log = run(cfg)
    first_solver = min(start(log, o) for o, *_ in log if o.kind == "rollout" and o.agent == "solver" and o.iteration == 0)
    assert all(end(log, o) <= first_solver for o, *_ in log if o.kind == "rollout" and o.agent == "planner" and o.iteration == 0)
    first_train = min(start(log, o) for o, *_ in log if o.kind == "train" and o.iteration == 0)
    assert all(end(log, o) <= first_train for o, *_ in log if o.kind == "rollout" and o.iteration == 0)
    it1 = min(start(log, o) for o, *_ in log if o.iteration == 1)
    assert all(end(log, o) <= it1 for o, *_ in log if o.iteration == 0)


def test_serial_runs_one_agent_at_a_time():
    """`serial`: two agents with no edge between them still roll out one after the other, and the
    agents train one after another, each after the previous one's sync."""
    fan = {"agents": [{"name": "a", "template": "{input}"}, {"name": "b", "template": "{input}"},
                      {"name": "c", "template": "{input} {a} {b}"}], "edges": ["a -> c", "b -> c"]}
    cfg = config_from_dict({"team": fan, "codesign": {**ALL_OFF, "serial": True}, "train": {"iterations": 2},
                            "batch": {"inputs_per_iteration": 4, "micro_batch_inputs": 2}})
    plan = Plan.build(cfg)
    sync = Plan.build(cfg.model_copy(update={"codesign": cfg.codesign.model_copy(update={"serial": False})}))
    assert Op(0, "rollout", "a", 0, 1) not in sync.deps[Op(0, "rollout", "b", 0, 0)]
    assert Op(0, "rollout", "a", 0, 1) in plan.deps[Op(0, "rollout", "b", 0, 0)]
    assert Op(1, "sync", "b") in plan.deps[Op(1, "train", "c", mb=0)]
    _, log = run(cfg)
    for kind in ("rollout", "train"):
        spans = {}
        for op, _, t0, t1 in log:
            if op.kind == kind:
                lo, hi = spans.get((op.iteration, op.agent), (t0, t1))
                spans[(op.iteration, op.agent)] = (min(lo, t0), max(hi, t1))
        order = sorted(spans.values())
        assert all(x[1] <= y[0] for x, y in zip(order, order[1:], strict=False)), (kind, spans)


def test_dependency_parallel_and_async_overlap():
    cfg = cfg_of({"load_balancing": False, "on_demand_allocation": False})
    plan = Plan.build(cfg)
    assert plan.deps[Op(0, "rollout", "solver", 0, 1)] == [Op(0, "rollout", "planner", 0, 1)]
    assert plan.deps[Op(0, "train", "solver", mb=1)] == [Op(0, "reward", mb=1)]
    assert plan.deps[Op(1, "rollout", "planner", 0, 0)] == [Op(0, "sync", "planner")]
    # The planner's mb=1 is held until the solver has started mb=0: the solver must not wait
    # for it (without dependency parallelism the hold would never be released in time).
    planner1, solver0 = Op(0, "rollout", "planner", 0, 1), Op(0, "rollout", "solver", 0, 0)
    res, log = run(cfg, holds={planner1: lambda seen: solver0 in seen.started})
    assert res.released == [planner1], "the solver's mb=0 waited for the planner's mb=1"
    assert start(log, solver0) < end(log, planner1)


@pytest.mark.parametrize("on_demand", [False, True])
def test_one_op_per_trainer_at_a_time(on_demand):
    cfg = cfg_of({"on_demand_allocation": on_demand}, iterations=3, mbs=3)
    res, log = run(cfg, delay=lambda op: 0.05 if op.kind == "train" else 0.005)
    for agent in ("planner", "solver", "verifier"):
        spans = sorted((t0, t1) for o, _, t0, t1 in log if o.agent == agent and o.kind in ("train", "step", "sync"))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), agent
        for it in range(3):
            homes = {w for o, w, *_ in log if o.agent == agent and o.iteration == it
                     and o.kind in ("train", "step", "sync")}
            assert len(homes) == 1, f"{agent}'s trainer moved within iteration {it}: {homes}"
        homes = {w for o, w, *_ in log if o.agent == agent and o.kind in ("train", "step", "sync")}
        if not on_demand:
            assert len(homes) == 1, f"static placement moved {agent}'s trainer: {homes}"
    slots = [d for d in res.decisions if isinstance(d, TrainSlot)]
    # On demand: one slot decision per (agent, iteration), recorded with the loads it saw.
    assert len(slots) == (9 if on_demand else 0)
    assert all(set(d.loads) == {"w0", "w1"} for d in slots)


def test_on_demand_slots_follow_free_workers():
    """On demand, an agent's iteration takes the training slot with the least work (seconds,
    not tasks), preferring the worker that holds its state unless another is clearly freer;
    moving elsewhere is recorded as a swap. Static placement never moves a trainer."""
    slots = {"w0": {"train": 1}, "w1": {"train": 1}}
    r = Router(load_balancing=True, on_demand=True, num_mb=2)

    def finish_iteration(it: int, agent: str) -> None:
        for op in [Op(it, "train", agent, mb=0), Op(it, "train", agent, mb=1), Op(it, "step", agent),
                   Op(it, "sync", agent)]:
            r.ledger.finished(op, None)

    assert r.route(Op(0, "train", "planner", mb=0), slots).worker == "w0"  # tie: by name
    # The allocation charged w0 the whole iteration: 2 micro-batches + step + sync.
    assert r.ledger.work["w0"] == pytest.approx(2 * 2.0 + 0.05 + 0.05) and r.ledger.work["w1"] == 0
    assert r.route(Op(0, "train", "planner", mb=1), slots).worker == "w0"  # same iteration: same slot
    finish_iteration(0, "planner")
    assert r.ledger.work["w0"] == 0
    r.ledger.work["w1"] = 3.0
    assert r.route(Op(1, "train", "planner", mb=0), slots).worker == "w0"  # no swap: state is here
    finish_iteration(1, "planner")
    r.ledger.work["w0"], r.ledger.work["w1"] = 2.0, 0.0
    assert r.route(Op(2, "train", "planner", mb=0), slots).worker == "w1"  # w0 busy: swap
    assert r.route(Op(2, "step", "planner"), slots).worker == "w1"
    d = [x for x in r.decisions if isinstance(x, TrainSlot)]
    assert [(x.iteration, x.worker, x.swap) for x in d] == [(0, "w0", False), (1, "w0", False), (2, "w1", True)]
    assert d[-1].state_was_on == "w0" and d[-1].work_s == {"w0": 2.0, "w1": 0.0}

    # Cost-aware: a solver micro-batch measured at 3 s weighs twice a planner's 1.5 s.
    r = Router(load_balancing=True, on_demand=True, num_mb=2)
    for agent, secs in [("solver", 3.0), ("verifier", 2.0), ("planner", 1.5)]:
        r.ledger.observe(Op(0, "train", agent, mb=0), secs)
    assert r.route(Op(1, "train", "solver", mb=0), slots).worker == "w0"
    assert r.route(Op(1, "train", "verifier", mb=0), slots).worker == "w1"
    # Task counts would tie (one iteration each); seconds say w1 (4.1 s) is freer than w0 (6.1 s).
    assert r.route(Op(1, "train", "planner", mb=0), slots).worker == "w1"

    # A slot whose worker vanished mid-iteration: the iteration moves, finished ops are not
    # charged again, and once everything finishes no work is left on any worker.
    r = Router(load_balancing=True, on_demand=True, num_mb=2)
    assert r.route(Op(0, "train", "planner", mb=0), slots).worker == "w0"
    r.ledger.finished(Op(0, "train", "planner", mb=0), None)
    r.ledger.completed.add(Op(0, "train", "planner", mb=0))
    assert r.route(Op(0, "train", "planner", mb=1), {"w1": {"train": 1}}).worker == "w1"
    assert r.ledger.work["w0"] == 0 and r.ledger.work["w1"] == pytest.approx(2.0 + 0.05 + 0.05)
    for op in [Op(0, "train", "planner", mb=1), Op(0, "step", "planner"), Op(0, "sync", "planner")]:
        r.ledger.finished(op, None)
    assert r.ledger.charges == {} and all(w == 0 for w in r.ledger.work.values())

    static = Router(load_balancing=True, on_demand=False)
    static.ledger.work["w0"] = 5.0
    homes = {static.route(Op(it, "train", "planner", mb=0), slots).worker for it in range(3)}
    assert homes == {"w0"} and static.decisions == []


def test_program_ops_run_one_per_rollout_instance():
    """A program team's micro-batch ops run at most one per rollout instance at once: the rest
    are held (None) until one ends, so micro-batches finish staggered and train while later ones
    roll out. A worker without a rollout tag is no instance."""
    workers = {"w0": {"rollout:planner": 1, "rollout:verifier": 1, "train": 1},
               "w1": {"rollout:solver": 1, "train": 1}, "w2": {"train": 1}}
    r = Router(load_balancing=True)
    progs = [Op(0, "program", mb=j) for j in range(4)]
    for op in progs[:2]:
        route = r.route(op, workers)
        assert route is not None and route.resources == {}
        r.ledger.submitted(op, route.worker)
    assert r.route(progs[2], workers) is None
    assert r.route(Op(0, "train", "planner", mb=0), workers) is not None  # other kinds go on
    r.ledger.finished(progs[0], None)
    assert r.route(progs[2], workers) is not None
    assert r.route(progs[3], {"w0": {"rollout": 1, "train": 1}}) is None  # one shared instance


def test_dedicated_rollout_tags_route_agents():
    workers = {"w0": {"rollout:planner": 1, "rollout:verifier": 1, "train": 1},
               "w1": {"rollout:solver": 1, "train": 1}}
    _, log = run(cfg_of(ALL_OFF), workers=workers)
    for o, w, *_ in log:
        if o.kind == "rollout":
            assert w == ("w1" if o.agent == "solver" else "w0"), (o.name, w)


def test_missing_tag_fails_fast_with_the_tag_named():
    """The first op that needs a tag no worker has ends the run, naming it, when it is routed:
    nothing waits for a worker that will never come (the run's stages log what they ran)."""
    workers = {"w0": {"rollout:planner": 1, "train": 1}}
    ran: list[Op] = []

    def delay(op: Op) -> float:
        ran.append(op)
        return 0.0

    with pytest.raises(OrchestratorError, match="rollout:solver"):
        run(cfg_of(ALL_OFF), workers=workers, delay=delay)
    assert sorted(ran) == sorted(Op(0, "rollout", "planner", 0, mb) for mb in range(2))


DEDICATED = {"w0": {"rollout:planner": 1, "rollout:verifier": 1, "train": 1},
             "w1": {"rollout:solver": 1, "train": 1}}


def test_balancer_moves_instances_to_the_hot_agent():
    """The planner is slow and has one instance (w0): the control plane gives it w1 too, the
    moves are recorded with loads and cost, and every op still runs exactly once."""
    cfg = cfg_of({"load_balancing": True, "dependency_parallel": True, "async_pipeline": False,
                  "on_demand_allocation": False}, iterations=2, mbs=4)
    # The planner's first rollout holds w0 until a planner rollout has started on w1, which
    # only a move can allow (w1 carries no planner tag at first).
    first = Op(0, "rollout", "planner", 0, 0)
    res, log = run(cfg, workers={w: dict(r) for w, r in DEDICATED.items()},
                   delay=lambda op: 0.1 if op.kind == "rollout" and op.agent == "planner" else 0.01,
                   holds={first: lambda seen: any(o.agent == "planner" and o.kind == "rollout" and w == "w1"
                                                  for o, w in seen.started.items())})
    assert res.released == [first], "no planner rollout ran on w1 while w0 was busy"
    plan = Plan.build(cfg)
    assert sorted(o for o, *_ in log) == sorted(plan.ops())
    moves = [d for d in res.decisions if isinstance(d, MoveInstance)]
    assert any(d.to_agent == "planner" and d.worker == "w1" for d in moves), moves
    assert all({"t", "loads", "from_agent", "to_agent", "cost_bytes", "monitor_us"} <= set(d.as_row()) for d in moves)
    assert {w for o, w, *_ in log if o.kind == "rollout" and o.agent == "planner"} == {"w0", "w1"}


def test_without_balancing_instances_stay_put():
    cfg = cfg_of({"load_balancing": False, "dependency_parallel": True, "async_pipeline": False,
                  "on_demand_allocation": False}, iterations=1, mbs=4)
    res, log = run(cfg, workers={w: dict(r) for w, r in DEDICATED.items()},
                   delay=lambda op: 0.05 if op.kind == "rollout" and op.agent == "planner" else 0.01)
    assert not [d for d in res.decisions if isinstance(d, MoveInstance)]
    assert {w for o, w, *_ in log if o.kind == "rollout" and o.agent == "planner"} == {"w0"}


ALL_ON = {"load_balancing": True, "dependency_parallel": True, "async_pipeline": True,
          "on_demand_allocation": True}


def _queued_rollouts(res) -> list[str]:
    """Rollouts submitted to a worker that still had an op of its own outstanding (rewards
    have no worker of their own: they run anywhere). Exact on the orchestrator's clock: an
    op's `finished` is stamped before the next submission wave."""
    pinned = [r for r in res.records if r.op.kind != "reward"]
    return [r.op.name for r in res.records if r.op.kind == "rollout" and any(
        o is not r and o.result.worker == r.result.worker and o.submitted <= r.submitted < o.finished
        for o in pinned)]


@pytest.mark.parametrize("late", [False, True])
def test_late_binding_holds_rollouts_until_an_instance_is_idle(late):
    """One long solver micro-batch and three short ones; the solver starts with w1 only.
    Early binding, on static instances (no balancing: nothing could lend w0 a solver instance
    between the planner parents' ends, so the schedule cannot dodge the queue), queues solver
    rollouts behind the long one; late binding (it needs balancing) submits each rollout to an
    idle worker only (w0 gets a solver instance). Every op still runs once and after its
    dependencies."""
    cfg = cfg_of({**ALL_ON, "late_binding": late, "load_balancing": late}, iterations=2, mbs=4)
    # The long one: the solver's mb=0 holds its worker until the solver's other rollouts of the
    # iteration have been submitted. Early binding submits them as their parents end, behind
    # mb=0 on w1; late binding only to an idle instance, one by one, on w0 once it is lent.
    long = Op(0, "rollout", "solver", 0, 0)
    others = {Op(0, "rollout", "solver", 0, mb) for mb in (1, 2, 3)}
    res, log = run(cfg, workers={w: dict(r) for w, r in DEDICATED.items()},
                   delay=lambda op: 0.08 if op.kind == "rollout" and op.agent == "solver" else 0.01,
                   holds={long: lambda seen: others <= seen.submitted})
    assert res.released == [long]
    plan = Plan.build(cfg)
    assert sorted(o for o, *_ in log) == sorted(plan.ops())
    for o, _, t0, _ in log:
        for d in plan.deps[o]:
            assert end(log, d) <= t0 + 1e-6, (o.name, d.name)
    queued = _queued_rollouts(res)
    solver_on = {w for o, w, *_ in log if o.kind == "rollout" and o.agent == "solver"}
    if late:
        assert queued == []
        assert solver_on == {"w0", "w1"}
        # w0 got a solver instance by a recorded move (the balancer's, or a lend of an idle worker)
        assert any(isinstance(d, MoveInstance) and d.to_agent == "solver" and d.worker == "w0"
                   for d in res.decisions)
    else:
        assert queued, "early binding should queue a rollout behind another on this schedule"


def test_late_binding_submits_trainer_ops_before_rollouts():
    """The order a late-binding wave submits in: trainer and reward ops of an iteration first,
    then its rollouts, the deepest MEG nodes first."""
    cfg = cfg_of({**ALL_ON, "late_binding": True}, iterations=2, mbs=2)
    ex = ThreadExecutor(lambda op, w: StageResult(op, worker=w), WORKERS)
    try:
        late = Orchestrator(Plan.build(cfg), cfg, ex).policies.late_binding
        assert late is not None
        key = late.key
    finally:
        ex.close()
    ops = [Op(0, "rollout", "verifier", mb=0), Op(0, "rollout", "solver", mb=1), Op(0, "train", "solver", mb=0),
           Op(1, "rollout", "planner", mb=0), Op(0, "rollout", "planner", mb=1), Op(0, "sync", "planner")]
    assert [o.name for o in sorted(ops, key=key)] == [
        "sync[planner] it=0", "train[solver] it=0 mb=0", "rollout[verifier] it=0 mb=0",
        "rollout[solver] it=0 mb=1", "rollout[planner] it=0 mb=1", "rollout[planner] it=1 mb=0"]


ONE_AGENT = {"agents": [{"name": "solver", "template": "{input}"}]}


def one_agent_cfg(iterations: int = 3, look_ahead: bool = True, fuse: bool = False):
    return config_from_dict({
        "team": ONE_AGENT, "train": {"iterations": iterations},
        "batch": {"inputs_per_iteration": 2, "micro_batch_inputs": 2},
        "cluster": {"workers": [{"name": "w0", "resources": {"rollout": 1, "train": 1}}],
                    "look_ahead": look_ahead, "fuse_chains": fuse},
    })


class LostOnce(Exception):
    """Stands in for a worker that died under an op (`ThreadExecutor` threads never do)."""


class LosingExecutor(ThreadExecutor):
    """Counts its submissions (one per op, or one per fused chain)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.submissions: list[list[Op]] = []

    def submit(self, op, route, deps=(), after=()):
        self.submissions.append([op])
        return super().submit(op, route, deps, after)

    def submit_fused(self, ops, route, deps=(), after=()):
        self.submissions.append(list(ops))
        return super().submit_fused(ops, route, deps, after)

    def lost(self, exc: BaseException) -> bool:
        return isinstance(exc, LostOnce)


def run_one_agent(cfg, lose: Op | None = None, delay_s: float = 0.02, fail: Op | None = None,
                  executor: list | None = None, until_chained: bool = False):
    """One agent on one worker: every op's route is fixed, so look-ahead chains the whole
    chain rollout -> reward -> train -> step -> sync -> next rollout. `lose`: that op's first
    run "loses its worker" after the op's delay. `until_chained`: each op is held at its start
    until every op that depends on it has been submitted (chained on it), or `HOLD_LIMIT_S`."""
    log: list[tuple[Op, float, float]] = []
    lock = threading.Lock()
    lost: list[Op] = []
    plan = Plan.build(cfg)
    children = {op: [c for c, ds in plan.deps.items() if op in ds] for op in plan.deps}

    def chained(op: Op) -> bool:
        subs = [o for sub in list(ex.submissions) for o in sub]
        return all(c in subs for c in children[op])

    def fn(op: Op, worker: str) -> StageResult:
        t0 = time.time()
        deadline = time.monotonic() + HOLD_LIMIT_S
        while until_chained and not chained(op) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(delay_s)
        if op == lose and not lost:
            lost.append(op)
            raise LostOnce(op.name)
        if op == fail:
            raise ValueError(f"{op.name} broke")
        with lock:
            log.append((op, t0, time.time()))
        return StageResult(op, worker=worker, t_start=t0, t_end=time.time())

    ex = LosingExecutor(fn, {"w0": {"rollout": 1, "train": 1}})
    if executor is not None:
        executor.append(ex)
    try:
        res = Orchestrator(Plan.build(cfg, window=1), cfg, ex).run()  # as a run builds it
    finally:
        ex.close()
    return res, log


def test_look_ahead_chains_ops_whose_route_is_fixed():
    """With look-ahead every op but the first is submitted while its dependency still runs
    (so the cluster starts it without waiting for this loop), yet starts only after it ends;
    without it, each op is submitted after its dependency ended."""
    cfg = one_agent_cfg()
    plan = Plan.build(cfg)
    for look_ahead in (True, False):
        # With look-ahead each op is held until its children are chained on it (they are
        # submitted while it runs, however long this loop takes to get there under load).
        res, log = run_one_agent(one_agent_cfg(look_ahead=look_ahead), until_chained=look_ahead)
        assert sorted(o for o, *_ in log) == sorted(plan.ops())
        ends = {o: t1 for o, _, t1 in log}
        starts = {o: t0 for o, t0, _ in log}
        submitted = {r.op: r.submitted for r in res.records}
        chained = 0
        for op, deps in plan.deps.items():
            for d in deps:
                assert ends[d] <= starts[op], (d.name, op.name)
            if deps:
                chained += submitted[op] < max(ends[d] for d in deps)
        with_deps = sum(1 for ds in plan.deps.values() if ds)
        assert chained == (with_deps if look_ahead else 0), (look_ahead, chained, with_deps)


def test_look_ahead_op_waits_again_when_its_dependency_is_lost():
    """A dependency whose worker is lost is resubmitted; the op chained on its lost run goes
    back to waiting (it is not counted as lost itself) and runs once, after the rerun."""
    lose = Op(1, "train", "solver", mb=0)
    exs: list = []
    res, log = run_one_agent(one_agent_cfg(), lose=lose, executor=exs, until_chained=True)
    # The step was chained on the run that was lost, then submitted again after the rerun.
    assert sum(Op(1, "step", "solver") in sub for sub in exs[0].submissions) == 2
    cfg = one_agent_cfg()
    plan = Plan.build(cfg)
    assert sorted(o for o, *_ in log) == sorted(plan.ops())  # every op succeeded exactly once
    resubmits = [d for d in res.decisions if type(d).__name__ == "Resubmit"]
    assert [d.op for d in resubmits] == [lose.name]
    step = Op(1, "step", "solver")
    assert next(t0 for o, t0, _ in log if o == step) >= next(t1 for o, _, t1 in log if o == lose)


def test_a_fixed_route_chain_runs_fused_one_task_per_iteration():
    """One agent on one worker: each iteration's rollout -> reward -> train -> step -> sync
    would all run on w0, so each is one fused run (one submission); every op still runs once,
    after its dependencies, and has its own record. Fusing off: one submission per op."""
    cfg = one_agent_cfg(fuse=True)
    plan = Plan.build(cfg)
    per_it = [o for o in plan.deps if o.iteration == 0]
    for fuse in (True, False):
        exs: list = []
        res, log = run_one_agent(one_agent_cfg(fuse=fuse), executor=exs)
        assert sorted(o for o, *_ in log) == sorted(plan.ops())
        assert sorted(r.op for r in res.records) == sorted(plan.ops())
        ends = {o: t1 for o, _, t1 in log}
        starts = {o: t0 for o, t0, _ in log}
        for op, deps in plan.deps.items():
            for d in deps:
                assert ends[d] <= starts[op], (d.name, op.name)
        subs = exs[0].submissions
        if fuse:
            assert [[o.kind for o in s] for s in subs] == [[o.kind for o in per_it]] * cfg.train.iterations
        else:
            assert all(len(s) == 1 for s in subs) and len(subs) == len(plan.deps)


def test_the_next_iterations_fused_run_is_chained_on_this_ones():
    """Fused, each iteration is one run; with look-ahead the next one is submitted while this
    one's run still goes (chained on it, so the cluster starts it as the sync ends), and each
    starts only after the sync it waits for."""
    cfg = one_agent_cfg(iterations=4, fuse=True)
    exs: list = []
    # Each op is held at its start until its children are submitted: the sync until the next
    # iteration's run is, however slow this loop is to get there.
    res, log = run_one_agent(cfg, executor=exs, until_chained=True)
    submitted = {r.op: r.submitted for r in res.records}
    ends = {o: t1 for o, _, t1 in log}
    starts = {o: t0 for o, t0, _ in log}
    assert [len(s) for s in exs[0].submissions] == [5] * cfg.train.iterations
    for it in range(1, cfg.train.iterations):
        sync, rollout = Op(it - 1, "sync", "solver"), Op(it, "rollout", "solver", mb=0)
        assert submitted[rollout] < ends[sync] <= starts[rollout], it


@pytest.mark.parametrize("look_ahead", [True, False])
@pytest.mark.parametrize("kind", ["train", "step", "sync"])
def test_a_fused_run_that_loses_its_worker_midway_keeps_what_ran(kind, look_ahead):
    """An op of iteration 1 "loses its worker" inside its fused run: the ops before it are
    recorded once, it is resubmitted (once) and takes the ops after it along again; every op
    runs and is recorded exactly once (without look-ahead, a stale second copy of it on the
    ready list would run it twice once its trainer is free)."""
    lose = Op(1, kind, "solver", mb=0 if kind == "train" else -1)
    exs: list = []
    res, log = run_one_agent(one_agent_cfg(iterations=4, fuse=True, look_ahead=look_ahead), lose=lose, executor=exs)
    cfg = one_agent_cfg(iterations=4)
    plan = Plan.build(cfg)
    assert sorted(o for o, *_ in log) == sorted(plan.ops())
    assert sorted(r.op for r in res.records) == sorted(plan.ops())  # no op recorded twice
    assert [d.op for d in res.decisions if type(d).__name__ == "Resubmit"] == [lose.name]
    kinds = ["train", "step", "sync"]
    assert [[o.kind for o in sub] for sub in exs[0].submissions if sub[0] == lose] == [kinds[kinds.index(kind):]]


def test_a_fused_run_whose_op_fails_records_the_ones_before_it():
    """A stage error (not a lost worker) inside a fused run ends the run naming that op; the
    ops of the run before it were recorded (their results reached the flow)."""
    fail = Op(1, "step", "solver")
    done: list[Op] = []

    cfg = one_agent_cfg(fuse=True)
    ex = LosingExecutor(lambda op, w: (_ for _ in ()).throw(ValueError("step broke")) if op == fail
                        else StageResult(op, worker=w), {"w0": {"rollout": 1, "train": 1}})
    try:
        orch = Orchestrator(Plan.build(cfg), cfg, ex,
                            hooks=[Callbacks(lambda rec: done.append(rec.op))])
        with pytest.raises(OrchestratorError, match=r"step\[solver\] it=1 failed: step broke"):
            orch.run()
    finally:
        ex.close()
    assert [o for o in done if o.iteration == 1] == [Op(1, "rollout", "solver", mb=0),
                                                     Op(1, "reward", mb=0), Op(1, "train", "solver", mb=0)]
