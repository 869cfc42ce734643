"""Joint Orchestrator: the event loop over a run's `Plan`.

    while ops are left:
        submit_ready()      route each ready op (control plane) and hand it to the executor
        collect_finished()  wait for any op; record it, release its children

It talks to an `Executor` (`executors/api.py`: submit with routing, wait for any, its clock) so
this module never imports Prefect or Dask: threads (tests), Prefect-on-Dask
(`tasks/executor.py`) and a simulated clock all run the same loop and the same control plane.
The loop's own rules are here (ready ops, one op per trainer, lost-worker resubmits, records);
when and in what shape an op is submitted besides (late binding, look-ahead, fusing) are the
submission policies of `policies.py`; what happens as ops end, its hooks (`hooks.py`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.control import ControlPlane, Decision, OrchestratorError, token_sizes
from flexmarl_core.executors.api import (
    AbandonsHungOps,
    ChainingExecutor,
    Executor,
    FusingExecutor,
    ReportsMemoryRestarts,
)
from flexmarl_core.ops import FusedResult, MemoryRestart, Op, OpRecord, Route, on_trainer, traits
from flexmarl_core.orchestrator.hooks import RunHook
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.orchestrator.policies import Running, Schedule, policies_for

__all__ = ["LOST_WORKER_RESUBMITS", "Executor", "ForgetsIterations", "Orchestrator", "OrchestratorError", "RunResult",
           "WorkerMemoryError"]

#: How often one op is resubmitted after losing its worker before the run gives up.
LOST_WORKER_RESUBMITS = 3


class WorkerMemoryError(OrchestratorError):
    """An op's worker was restarted by Dask for crossing its memory limit: names the op, the
    agent, the worker and its limit, and the knob that lowers the op's memory."""

    def __init__(self, op: Op, restarts: Sequence[MemoryRestart], fused: Sequence[Op] = ()) -> None:
        self.op, self.restarts = op, list(restarts)
        within = f" (in one fused task with {', '.join(o.name for o in fused if o != op)})" if fused else ""
        first = self.restarts[0]
        hint = {
            "train": f"lower team.agents[{op.agent}].backend.train_chunk_tokens (or turn on "
                     "backend.activation_checkpointing)",
            "step": f"lower team.agents[{op.agent}].backend.train_chunk_tokens",
            "rollout": "lower batch.micro_batch_inputs or the agent's sampling.max_new_tokens",
        }.get(op.kind, "lower batch.micro_batch_inputs")
        super().__init__(
            f"{op.name} (agent {op.agent!r}){within} failed: Dask restarted its {first.describe()} for "
            f"memory ({len(self.restarts)} restart(s) while it ran; the Nanny restarts a worker at "
            f"95% of its limit); {hint}, or raise cluster.workers[{first.worker}].memory_limit"
        )


@dataclass
class RunResult:
    #: the ops this run finished, in the order they ended (empty with `keep_records=False`)
    records: list[OpRecord]
    wall_s: float
    started: float
    #: control-plane decisions: instance moves, training-slot allocations, resubmissions
    decisions: list[Decision] = field(default_factory=list)
    #: how many ops this run finished
    ops: int = 0


@runtime_checkable
class ForgetsIterations(Protocol):
    """An executor that keeps per-op state (a task run per op) and can drop it for the
    iterations no op still to come refers to."""

    def forget(self, below: int) -> None:
        """Drop what is kept of the ops of iterations before `below`."""


class Orchestrator:
    """Submits each op when its dependencies are done, with the route chosen at that moment,
    under the submission policies the config and the executor allow (`policies.policies_for`),
    calling `hooks` as ops end. `sizes`: the
    control plane's op sizes for its warm estimates (default: `token_sizes` of the config).
    `rollout_slots`: see `Router` (the simulator's replica release).

    Its memory is flat over a run of any length: the plan's iterations are admitted as the
    run reaches them (a plan built with a window is extended, `Plan.extend`) and an iteration
    whose ops are all done is forgotten, here, in the control plane, the executor
    (`ForgetsIterations`) and a windowed plan. `keep_records=False`: the records are the
    hooks' to keep (`RunResult.records` stays empty)."""

    def __init__(
        self,
        plan: Plan,
        cfg: ExperimentConfig,
        executor: Executor,
        *,
        hooks: Sequence[RunHook] = (),
        skip: Iterable[Op] = (),
        sizes: dict[str, dict[str, float]] | None = None,
        rollout_slots: Callable[[str], int] | None = None,
        keep_records: bool = True,
    ) -> None:
        self.plan = plan
        self.executor = executor
        self.control = ControlPlane(cfg, plan.meg.agent_names, executor.now,
                                    sizes=token_sizes(plan.meg) if sizes is None else sizes,
                                    rollout_slots=rollout_slots)
        self.hooks = list(hooks)
        #: ops an earlier attempt completed (resume): they count as done
        self.skip = set(skip)
        self.control.ledger.completed.update(self.skip)
        self.policies = policies_for(plan, cfg, executor, self.control)
        self.state = Schedule(plan.deps, self.skip)
        self.keep_records = keep_records

    def run(self) -> RunResult:
        st = self.state = Schedule(self.plan.deps, self.skip)
        #: admission order, which is topological: finished ops are recorded dependencies first
        self._order: dict[Op, int] = {}
        self._resubmits: dict[Op, int] = {}
        self._records: list[OpRecord] = []
        self._n = 0  # ops recorded
        self._seq = 0
        #: ops admitted and not done, in all and per iteration
        self._left = 0
        self._open: dict[int, int] = defaultdict(int)
        self._admitted = 0  # iterations admitted: [0, _admitted)
        # What can be ready at the start: up to `reach` iterations past the last one an earlier
        # attempt touched (its syncs gate them), iterations 0 .. reach-1 on a fresh run.
        last_skip = max((op.iteration for op in self.skip), default=-1)
        self._reach(last_skip + self.plan.reach)
        t0 = self.executor.now()
        while self._left:
            self._submit_ready()
            if self.policies.look_ahead is not None:
                # The iteration after the newest running op's is admitted now, not once an op
                # of it ends: its first ops then chain on this one's last (its syncs) and start
                # as they end, without a round trip through this loop. One on, not `reach`:
                # the admitted window stays what recording admits (`_record`).
                newest = max((r.op.iteration for r in st.running.values() if not r.pending), default=None)
                if newest is not None:
                    self._reach(newest + 1, advance=False)
                for op, route, pending in self.policies.look_ahead.ahead(st, self._live_workers):
                    self._submit(op, route, pending)
            if not st.running:
                raise OrchestratorError(
                    f"deadlock: {self._left} ops left but none runnable: "
                    f"{[o.name for o in st.ready][:5]}"
                )
            self._collect_finished()
        return RunResult(records=self._records, wall_s=self.executor.now() - t0, started=t0,
                         decisions=list(self.control.decisions), ops=self._n)

    def _reach(self, through: int, *, advance: bool = True) -> None:
        """Admit the plan's iterations up to `through` (one at a time, forgetting what is done
        on the way), and more while nothing admitted is left to run."""
        plan, st = self.plan, self.state
        while self._admitted < plan.iterations and (self._admitted <= through or not self._left):
            it = self._admitted
            if plan.built <= it:
                plan.extend(it)
            for op in plan.iteration_ops(it):
                self._admit(op, st)
            self._admitted += 1
            if advance:
                self._advance()

    def _admit(self, op: Op, st: Schedule) -> None:
        self._order[op] = self._seq
        self._seq += 1
        self._resubmits[op] = 0
        waiting = 0
        for d in self.plan.deps[op]:
            if not st.done(d):
                st.children[d].append(op)
                waiting += 1
        st.waiting[op] = waiting
        if op in self.skip:
            return
        self._left += 1
        self._open[op.iteration] += 1
        if waiting == 0:
            st.ready.append(op)

    def _advance(self) -> None:
        """Move the floor past the iterations whose ops are all done and forget them: no op
        still to come waits for an op more than `plan.reach` iterations back."""
        st, floor = self.state, self.state.floor
        while floor < self._admitted and not self._open.get(floor):
            self._open.pop(floor, None)
            floor += 1
        if floor == st.floor:
            return
        gone = [op for op in self._order if op.iteration < floor]
        for op in gone:
            del self._order[op]
            self._resubmits.pop(op, None)
            st.children.pop(op, None)
            st.waiting.pop(op, None)
            st.recorded.discard(op)
            self.skip.discard(op)
        st.floor = floor
        self.control.forget(floor)
        if self.plan.window is not None:
            self.plan.forget(floor)
        if isinstance(self.executor, ForgetsIterations):
            self.executor.forget(floor - self.plan.reach)

    def in_flight_since(self) -> float | None:
        """When the earliest op still running was submitted (None: nothing is running)."""
        return min((r.submitted for r in self.state.running.values()), default=None)

    def _submit(self, op: Op, route: Route, pending: set[Op] | None = None,
                workers: dict[str, dict[str, float]] | None = None) -> None:
        st = self.state
        # the ops of the runs `op` is chained on: they end before it starts
        before = {o for d in pending or () for o, _ in st.running[st.handle[d]].ops}
        fusing = self.policies.fusing
        tail: list[tuple[Op, Route]] = []
        union: dict[str, float] = {}
        if fusing is not None and not route.gradient_only:  # a helper's chain goes on at the trainer
            tail, union = fusing.tail(st, op, route, workers, before, self._live_workers)
        after = list(dict.fromkeys(st.handle[d] for d in sorted(pending or ())))
        ex = self.executor
        if tail:
            assert isinstance(ex, FusingExecutor)  # `policies_for` fuses only on such executors
            ops = [op, *(o for o, _ in tail)]
            deps = [[d for d in self.plan.deps[o] if d not in self.skip] for o in ops]
            handle = ex.submit_fused(ops, Route(union, route.worker), deps, after=after)
        elif after:
            assert isinstance(ex, ChainingExecutor)  # only the look-ahead chains
            handle = ex.submit(op, route, [d for d in self.plan.deps[op] if d not in self.skip], after=after)
        else:
            handle = ex.submit(op, route, [d for d in self.plan.deps[op] if d not in self.skip])
        run = Running(op, ex.now(), route, set(pending or ()), tail)
        run.since = run.submitted
        # A resubmission after a hang or a lost worker starts cold (a restarted worker builds
        # its engine and loads weights inside the op): twice the time per earlier attempt, or a
        # loaded machine restarts the same worker again and again for an op that is not hung.
        run.deadline_s = sum(self.control.deadline(o, r) for o, r in run.ops) * 2 ** self._resubmits[op]
        st.running[handle] = run
        for o, r in run.ops:
            st.handle[o] = handle
            self.control.submitted(o, r)
            if on_trainer(o.kind) and not r.gradient_only:
                st.trainer_ops[o.agent].add(o)

    def _unsubmit(self, handle: Any, run: Running) -> None:
        """Forget a submitted run (it ended, or goes back to waiting): every op of it."""
        for o, r in run.ops:
            self.state.handle.pop(o, None)
            self.control.finished(o, r)
            self.state.trainer_ops[o.agent].discard(o)

    def _submit_ready(self) -> None:
        st = self.state
        if not st.ready:
            return
        late = self.policies.late_binding
        st.ready.sort(key=late.key if late is not None else None)
        workers = self.control.place(
            st.ready, [(r.op, r.route) for r in st.running.values()], self._live_workers(),
            self.executor.set_worker_resources,
        )
        if late is not None:
            late.begin_wave(st)
        held = []
        for op in st.ready:
            if op in st.handle or st.done(op):
                continue  # fused into a run submitted earlier in this wave, or already done
            # An agent's trainer runs one op at a time; only a gradient helper (an idle slot
            # computing a train op's gradient, `codesign.gradient_helpers`) goes meanwhile.
            busy = on_trainer(op.kind) and bool(st.trainer_ops[op.agent])
            if busy and not self.control.router.may_help(op):
                held.append(op)
                continue
            if late is not None and late.holds(op):
                held.append(op)
                continue
            route = self.control.route(op, workers)
            # None: no idle instance yet (late binding); a busy trainer's op that no helper took waits
            if route is None or (busy and not route.gradient_only):
                held.append(op)
                continue
            self._submit(op, route, workers=workers)
        st.ready = held

    def _collect_finished(self) -> None:
        st = self.state
        done = self.executor.wait_any(list(st.running), timeout=self._until_hung())
        if not done:
            self._abandon_hung()
            return
        done.sort(key=lambda h: self._order[st.running[h].op])  # dependencies first
        for handle in done:
            if handle not in st.running:
                continue  # a chained op put back to waiting earlier in this batch
            run = st.running[handle]
            op = run.op
            if run.pending and self._ok(handle):
                continue  # cannot happen (a dependency ends first): collect it after its record
            del st.running[handle]
            self._unsubmit(handle, run)
            try:
                res = self.executor.result(handle)
            except Exception as exc:
                if run.pending:
                    # Chained on a dependency that did not end well: if it failed, its own
                    # error ends the run when it is collected; if it was lost, it is
                    # resubmitted and this op waits for it again.
                    self._cancel(handle)
                    continue
                self._failed(run, op, exc)
                continue
            if not isinstance(res, FusedResult):
                self._record(OpRecord(op, run.submitted, self.executor.now(), res))
                continue
            # A fused run: record the ops that ran; the one that failed is handled as a
            # failed op; the ones after it go back to waiting (their dependency is unrecorded).
            # Every op of the run is excluded from release: the ones that ran are recorded
            # here, the failed one is requeued by `_failed` (once), the rest wait for it.
            members = {o for o, _ in run.ops}
            for r in res.results:
                self._record(OpRecord(r.op, run.submitted, self.executor.now(), r), members)
            if res.error is not None:
                failed = run.ops[len(res.results)][0]
                for o, _ in run.ops[len(res.results) + 1:]:
                    self._drop_chained(o)
                self._failed(run, failed, res.error)

    def _failed(self, run: Running, op: Op, exc: BaseException) -> None:
        """`op` of `run` raised `exc`: resubmit it if its worker was lost, else end the run."""
        lost = self.executor.lost(exc)
        if lost:
            # A worker Dask restarted for memory will be restarted again for the same
            # op: say so now, instead of the "no valid worker" timeout it ends in. A fused
            # task that died as a whole: name its heaviest op (a train op) and all of them.
            whole = [o for o, _ in run.ops] if op == run.op and run.tail else []
            heavy = next((o for o in whole if traits(o.kind).trains), op)
            self._raise_if_memory(heavy, run.submitted, exc, whole)
        if lost and self._resubmits[op] < LOST_WORKER_RESUBMITS:
            # Its worker died: every stage is idempotent and rebuilds its engine or
            # trainer from published weights / checkpoints, so run it again elsewhere.
            self.control.resubmitted(op, dict(run.ops)[op], exc)
            self._requeue(run, op)
            return
        raise OrchestratorError(f"{op.name} failed: {exc}") from exc

    def _requeue(self, run: Running, op: Op) -> None:
        self._resubmits[op] += 1
        for o, _ in run.ops:
            self._drop_chained(o)
        self.state.ready.append(op)  # a fused run's later ops wait for it again

    def _until_hung(self) -> float | None:
        """Seconds until the first running op passes its deadline (None: never checked)."""
        if not isinstance(self.executor, AbandonsHungOps):
            return None
        due = min((r.since + r.deadline_s for r in self.state.running.values() if not r.pending),
                  default=float("inf"))
        return None if due == float("inf") else max(due - self.executor.now(), 0.0)

    def _abandon_hung(self) -> None:
        """Every op that runs past its deadline: cancelled, its worker restarted, the op routed
        and submitted again (idempotent stages make the rerun safe), at most
        `LOST_WORKER_RESUBMITS` times. One still waiting for a worker is not hung: its clock
        starts again."""
        st, ex = self.state, self.executor
        assert isinstance(ex, AbandonsHungOps)
        now = ex.now()
        for handle, run in list(st.running.items()):
            if run.pending or now < run.since + run.deadline_s or handle not in st.running:
                continue
            where = ex.running_on(handle)
            if where is None:
                run.since = now
                continue
            worker = ex.abandon(handle, where)
            del st.running[handle]
            self._unsubmit(handle, run)
            # A fused run is one task: name every op of it, the one that hung among them.
            what = " + ".join(o.name for o, _ in run.ops)
            self.control.hung(what, worker, run.deadline_s, now - run.since)
            if self._resubmits[run.op] >= LOST_WORKER_RESUBMITS:
                raise OrchestratorError(
                    f"{what} hung {self._resubmits[run.op] + 1} times: it ran past its "
                    f"deadline of {run.deadline_s:.0f} s (cluster.deadlines) on worker {worker}")
            self._requeue(run, run.op)

    def _record(self, rec: OpRecord, ran: set[Op] | frozenset[Op] = frozenset()) -> None:
        """Record a finished op, call the hooks and release its children (`ran`: the ops of
        its fused run, which are recorded or requeued with the run, so never released here)."""
        st, op = self.state, rec.op
        self._n += 1
        if self.keep_records:
            self._records.append(rec)
        st.recorded.add(op)
        self._left -= 1
        self._open[op.iteration] -= 1
        # Its children, up to `plan.reach` iterations on, must be admitted before release.
        self._reach(op.iteration + self.plan.reach, advance=False)
        self.control.observed(rec.result)
        if self.hooks:
            since = self.in_flight_since()
            for hook in self.hooks:
                hook.op_done(rec, in_flight_since=since, decisions=self.control.decisions)
        for c in st.children[op]:
            st.waiting[c] -= 1
            h = st.handle.get(c)
            if h is not None:
                chained = st.running[h]
                chained.pending.discard(op)
                if not chained.pending:
                    chained.since = self.executor.now()  # it starts now: its deadline too
            elif st.waiting[c] == 0 and c not in self.skip and c not in ran:
                st.ready.append(c)
        self._advance()

    def _ok(self, handle: Any) -> bool:
        return isinstance(self.executor, ChainingExecutor) and self.executor.succeeded(handle)

    def _drop_chained(self, op: Op) -> None:
        """`op` is resubmitted: the ops chained on its lost run go back to waiting."""
        st = self.state
        for c in st.children[op]:
            h = st.handle.get(c)
            if h is not None and op in st.running[h].pending:
                run = st.running.pop(h)
                self._unsubmit(h, run)
                self._cancel(h)

    def _cancel(self, handle: Any) -> None:
        if isinstance(self.executor, ChainingExecutor):
            self.executor.cancel(handle)

    def _raise_if_memory(self, op: Op, since: float, exc: BaseException, fused: Sequence[Op] = ()) -> None:
        ex = self.executor
        restarts = ex.memory_restarts(since) if isinstance(ex, ReportsMemoryRestarts) else []
        if restarts:
            raise WorkerMemoryError(op, restarts, fused) from exc

    def _live_workers(self, patience_s: float = 60.0) -> dict[str, dict[str, float]]:
        """Current worker tags. No workers at all means the cluster is (re)starting one, so
        wait for it; workers that lack a tag are a config error the router reports at once."""
        deadline = time.monotonic() + patience_s
        while True:
            workers = self.executor.worker_resources()
            if workers or time.monotonic() > deadline:
                return workers
            time.sleep(0.5)
