"""Joint Orchestrator: the event loop over a run's `Plan`.

    while ops are left:
        submit_ready()      route each ready op (control plane) and hand it to the executor
        collect_finished()  wait for any op; record it, release its children

It talks to an `Executor` (submit with routing, wait for any, its clock) so this module never
imports Prefect or Dask: threads (tests), Prefect-on-Dask (`tasks/executor.py`) and a simulated
clock all run the same loop and the same control plane.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.control import ControlPlane, Decision, OrchestratorError
from flexmarl_core.meg import NodeKey
from flexmarl_core.ops import (
    TRAINER_KINDS,
    FusedResult,
    MemoryRestart,
    Op,
    OpRecord,
    Route,
    StageResult,
)
from flexmarl_core.plan import Plan

__all__ = ["LOST_WORKER_RESUBMITS", "Executor", "Orchestrator", "OrchestratorError", "RunResult",
           "WorkerMemoryError"]


class Executor(Protocol):
    """What the orchestrator needs from a cluster. Implementations: `executors.ThreadExecutor`,
    `cluster.DaskExecutor` (plain Dask), `tasks.executor.PrefectDaskExecutor` (the real run)."""

    def submit(self, op: Op, route: Route, deps: Sequence[Op]) -> Any:
        """Start `op` where `route` says; `deps` are the ops it waited for (done, or chained
        on), which an executor may record (the Prefect UI draws them as the graph's edges)."""
        ...

    def wait_any(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]: ...

    def result(self, handle: Any) -> StageResult | FusedResult: ...

    def now(self) -> float:
        """The executor's clock (wall time for real runs, virtual time for a simulation)."""
        ...

    def worker_resources(self) -> dict[str, dict[str, float]]:
        """Current resource tags of every worker, by worker address."""
        ...

    def set_worker_resources(self, worker: str, resources: dict[str, float]) -> None: ...

    def lost(self, exc: BaseException) -> bool:
        """True when `exc` means the op's worker died or vanished (not that the op failed):
        the orchestrator then routes and submits the op again."""
        ...

    # Optional: `memory_restarts(since) -> list[MemoryRestart]`, the workers restarted for
    # memory since `since` (executor clock); a lost op with any fails as `WorkerMemoryError`.
    # Optional, for look-ahead: `chains = True`, `submit(..., after=handles)` starting the op
    # only once those handles' ops ended well, `cancel(handle)`, `succeeded(handle) -> bool`.
    # Optional, for fusing: `fuses = True`, `submit_fused(ops, route, deps, after=handles)`
    # running a chain of ops in order in one task, whose `result` is a `FusedResult`.


#: How often one op is resubmitted after losing its worker before the run gives up.
LOST_WORKER_RESUBMITS = 3
#: The most ops fused into one run (a chain is cut at its iteration's end anyway).
MAX_FUSED = 16


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
    records: list[OpRecord]
    wall_s: float
    started: float
    #: control-plane decisions: instance moves, training-slot allocations, resubmissions
    decisions: list[Decision] = field(default_factory=list)


@dataclass
class _Running:
    op: Op
    submitted: float
    route: Route
    #: look-ahead: the dependencies it was chained on that have not ended yet (as seen here)
    pending: set[Op] = field(default_factory=set)
    #: fused: the ops that run after `op` in the same task, each with its own route
    tail: list[tuple[Op, Route]] = field(default_factory=list)

    @property
    def ops(self) -> list[tuple[Op, Route]]:
        return [(self.op, self.route), *self.tail]


class Orchestrator:
    """Submits each op when its dependencies are done, with the route chosen at that moment.

    Look-ahead (`look_ahead`, on when the executor can chain ops: `chains = True`): an op
    whose dependencies are all submitted, and whose route no later decision could change
    (`ControlPlane.route_ahead`), is submitted at once, chained on its running dependencies,
    so the cluster starts it the moment they end instead of after a round trip through this
    loop. One level deep: only the children of ops that can run now, which bounds it to the
    next op of each chain. A chained op whose dependency is lost goes back to waiting; one
    whose dependency failed fails with it (the dependency's error is the one raised).

    Fusing (`fuse`, on when the executor can: `fuses = True`): an op submitted with a fixed
    route takes along the chain that follows it within its iteration, one task for all, while
    each next op is the only one its predecessor releases, has no other dependency left, and
    would run on the same worker anyway (`_fuse_tail`). The chain then pays one dispatch and
    one scheduler transition instead of one per op; each op still has its own record, task
    run and retries. A fused run that stops at a failed op returns the ones before it; the
    rest go back to waiting.
    """

    def __init__(
        self,
        plan: Plan,
        cfg: ExperimentConfig,
        executor: Executor,
        *,
        on_op_done: Callable[[OpRecord], None] | None = None,
        skip: Iterable[Op] = (),
        look_ahead: bool | None = None,
        fuse: bool | None = None,
    ) -> None:
        self.plan = plan
        self.executor = executor
        self.control = ControlPlane(cfg, plan.meg.agent_names, executor.now)
        self.on_op_done = on_op_done
        #: ops an earlier attempt completed (resume): they count as done
        self.skip = set(skip)
        self.control.ledger.completed.update(self.skip)
        chains = bool(getattr(executor, "chains", False))
        # Late binding decides where a rollout runs when a worker frees; an op chained ahead
        # would count against an idle worker and keep it from taking one, so it goes without.
        self.look_ahead = chains and not self.control.late_binding and (
            cfg.cluster.look_ahead if look_ahead is None else look_ahead)
        self.fuse = bool(getattr(executor, "fuses", False)) and not self.control.late_binding and (
            cfg.cluster.fuse_chains if fuse is None else fuse)
        self._running: dict[Any, _Running] = {}
        self._late_key = self._late_binding_order(plan) if self.control.late_binding else None

    @staticmethod
    def _late_binding_order(plan: Plan) -> Callable[[Op], tuple]:
        """Submission order when rollouts wait for an idle instance: per iteration, trainer and
        reward ops first (they lead to the weight sync the next iteration waits for), then
        rollouts of the deepest MEG nodes first: a verifier's turn on a finished micro-batch
        releases its reward and training, which otherwise pile up behind the solver's long
        turns. Replayed on 7 long-tail runs' measured ops (`bench/bound.py`), this beat
        roots-first by 1% on average at 4 micro-batches and by 10% at 8."""
        depth: dict[NodeKey, int] = {}

        def d(node: NodeKey) -> int:
            if node not in depth:
                depth[node] = 1 + max((d(p) for p in plan.meg.parents[node]), default=-1)
            return depth[node]

        def key(op: Op) -> tuple:
            if op.kind != "rollout":
                return (op.iteration, 0, 0, op)
            return (op.iteration, 1, -d(NodeKey(op.agent, op.turn)), op)

        return key

    def run(self) -> RunResult:
        deps, skip = self.plan.deps, self.skip
        self._children: dict[Op, list[Op]] = defaultdict(list)
        for op, ds in deps.items():
            for d in ds:
                self._children[d].append(op)
        #: plan order is topological: finished ops are recorded dependencies first
        self._order = {op: i for i, op in enumerate(deps)}
        self._waiting = {op: sum(1 for d in ds if d not in skip) for op, ds in deps.items()}
        self._ready = [op for op, n in self._waiting.items() if n == 0 and op not in skip]
        #: one op per trainer at a time: its state lives in one worker's memory and accumulates
        #: (a chained trainer op may wait on the running one: it starts only after it)
        self._trainer_ops: dict[str, set[Op]] = defaultdict(set)
        self._resubmits: dict[Op, int] = defaultdict(int)
        self._running = {}
        self._handle: dict[Op, Any] = {}
        self._recorded: set[Op] = set()
        self._records: list[OpRecord] = []
        t0 = self.executor.now()
        total = sum(1 for op in deps if op not in skip)
        while len(self._records) < total:
            self._submit_ready()
            if self.look_ahead:
                self._submit_ahead()
            if not self._running:
                raise OrchestratorError(
                    f"deadlock: {total - len(self._records)} ops left but none runnable: "
                    f"{[o.name for o in self._ready][:5]}"
                )
            self._collect_finished()
        return RunResult(records=self._records, wall_s=self.executor.now() - t0, started=t0,
                         decisions=list(self.control.decisions))

    def in_flight_since(self) -> float | None:
        """When the earliest op still running was submitted (None: nothing is running)."""
        return min((r.submitted for r in self._running.values()), default=None)

    def _submit(self, op: Op, route: Route, pending: set[Op] | None = None,
                workers: dict[str, dict[str, float]] | None = None) -> None:
        # the ops of the runs `op` is chained on: they end before it starts
        before = {o for d in pending or () for o, _ in self._running[self._handle[d]].ops}
        fuse = self.fuse and not route.gradient_only  # a helper's chain goes on at the trainer
        tail, union = self._fuse_tail(op, route, workers, before) if fuse else ([], {})
        after = list(dict.fromkeys(self._handle[d] for d in sorted(pending or ())))
        if tail:
            ops = [op, *(o for o, _ in tail)]
            deps = [[d for d in self.plan.deps[o] if d not in self.skip] for o in ops]
            handle = self.executor.submit_fused(ops, Route(union, route.worker), deps, after=after)  # type: ignore[attr-defined]
        else:
            deps1 = [d for d in self.plan.deps[op] if d not in self.skip]
            if after:
                handle = self.executor.submit(op, route, deps1, after=after)  # type: ignore[call-arg]
            else:
                handle = self.executor.submit(op, route, deps1)
        run = _Running(op, self.executor.now(), route, set(pending or ()), tail)
        self._running[handle] = run
        for o, r in run.ops:
            self._handle[o] = handle
            self.control.submitted(o, r)
            if o.kind in TRAINER_KINDS and not r.gradient_only:
                self._trainer_ops[o.agent].add(o)

    def _fuse_tail(self, head: Op, route: Route, workers: dict[str, dict[str, float]] | None,
                   before: set[Op]) -> tuple[list[tuple[Op, Route]], dict[str, float]]:
        """The chain after `head` that can run in its task (see the class docstring), and the
        resources the task needs (the union of its ops'): each next op is the only unfinished
        child of the one before, within the iteration, waits for nothing outside the chain,
        and its fixed route is the same place (the same pinned worker; or, unpinned, resources
        some one worker has together with the head's)."""
        tail: list[tuple[Op, Route]] = []
        chain, last, need = {head}, head, dict(route.resources)
        while len(chain) < MAX_FUSED:
            kids = [c for c in self._children[last] if c not in self.skip and c not in self._recorded]
            if len(kids) != 1:
                break
            c = kids[0]
            if c.iteration != head.iteration or c in self._handle:
                break
            if any(d not in chain and d not in self._recorded and d not in self.skip for d in self.plan.deps[c]):
                break
            if c.kind in TRAINER_KINDS and not self._trainer_ops[c.agent] <= chain | before:
                break  # the trainer is busy with an op that may still run alongside
            workers = workers if workers is not None else self._live_workers()
            r = self.control.route_ahead(c, workers)
            if r is None or (r.worker is not None and r.worker != route.worker):
                break
            grown = {**need, **{k: max(v, need.get(k, 0.0)) for k, v in r.resources.items()}}
            fits = [w for w, res in workers.items() if all(res.get(k, 0) >= v for k, v in grown.items())]
            if (route.worker is not None and route.worker not in fits) or (route.worker is None and len(fits) != 1):
                break  # not the same place (unpinned: Dask could place them apart)
            need = grown
            tail.append((c, r))
            chain.add(c)
            last = c
        return tail, need

    def _unsubmit(self, handle: Any, run: _Running) -> None:
        """Forget a submitted run (it ended, or goes back to waiting): every op of it."""
        for o, r in run.ops:
            self._handle.pop(o, None)
            self.control.finished(o, r)
            self._trainer_ops[o.agent].discard(o)

    def _submit_ready(self) -> None:
        if not self._ready:
            return
        self._ready.sort(key=self._late_key)
        workers = self.control.place(
            self._ready, [(r.op, r.route) for r in self._running.values()], self._live_workers(),
            self.executor.set_worker_resources,
        )
        held = []
        # Late binding: while a reward runs, its train ops are about to want a worker; a
        # rollout started now would hold the one that is free for its whole length.
        rewards_pending = self._late_key is not None and any(
            o.kind == "reward" for o in [*self._ready, *(r.op for r in self._running.values())])
        for op in self._ready:
            if op in self._handle or op in self._recorded:
                continue  # fused into a run submitted earlier in this wave, or already done
            # An agent's trainer runs one op at a time; only a gradient helper (an idle slot
            # computing a train op's gradient, `codesign.gradient_helpers`) goes meanwhile.
            busy = op.kind in TRAINER_KINDS and bool(self._trainer_ops[op.agent])
            if busy and not self.control.router.may_help(op):
                held.append(op)
                continue
            if op.kind == "rollout" and rewards_pending:
                held.append(op)
                continue
            route = self.control.route(op, workers)
            # None: no idle instance yet (late binding); a busy trainer's op that no helper took waits
            if route is None or (busy and not route.gradient_only):
                held.append(op)
                continue
            self._submit(op, route, workers=workers)
        self._ready = held

    def _submit_ahead(self) -> None:
        """Chain the children of ops that can run now (see the class docstring)."""
        workers: dict[str, dict[str, float]] | None = None
        for run in list(self._running.values()):
            if run.pending:
                continue
            for c in (c for o, _ in run.ops for c in self._children[o]):
                if c in self._handle or c in self.skip or self._waiting[c] == 0:
                    continue  # running, done earlier, or ready (the ready path takes it)
                pending = {d for d in self.plan.deps[c] if d not in self.skip and d not in self._recorded}
                if any(d not in self._handle or self._running[self._handle[d]].pending for d in pending):
                    continue  # a dependency not submitted yet, or itself chained: too far ahead
                if c.kind in TRAINER_KINDS and not self._trainer_ops[c.agent] <= pending:
                    continue  # the trainer is busy with an op it does not wait for
                workers = workers if workers is not None else self._live_workers()
                route = self.control.route_ahead(c, workers)
                if route is not None:
                    self._submit(c, route, pending, workers)

    def _collect_finished(self) -> None:
        done = self.executor.wait_any(list(self._running))
        done.sort(key=lambda h: self._order[self._running[h].op])  # dependencies first
        for handle in done:
            if handle not in self._running:
                continue  # a chained op put back to waiting earlier in this batch
            run = self._running[handle]
            op = run.op
            if run.pending and self._ok(handle):
                continue  # cannot happen (a dependency ends first): collect it after its record
            del self._running[handle]
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

    def _failed(self, run: _Running, op: Op, exc: BaseException) -> None:
        """`op` of `run` raised `exc`: resubmit it if its worker was lost, else end the run."""
        lost = self.executor.lost(exc)
        if lost:
            # A worker Dask restarted for memory will be restarted again for the same
            # op: say so now, instead of the "no valid worker" timeout it ends in. A fused
            # task that died as a whole: name its heaviest op (a train op) and all of them.
            whole = [o for o, _ in run.ops] if op == run.op and run.tail else []
            heavy = next((o for o in whole if o.kind == "train"), op)
            self._raise_if_memory(heavy, run.submitted, exc, whole)
        if lost and self._resubmits[op] < LOST_WORKER_RESUBMITS:
            # Its worker died: every stage is idempotent and rebuilds its engine or
            # trainer from published weights / checkpoints, so run it again elsewhere.
            self._resubmits[op] += 1
            self.control.resubmitted(op, dict(run.ops)[op], exc)
            for o, _ in run.ops:
                self._drop_chained(o)
            self._ready.append(op)  # a fused run's later ops wait for it again
            return
        raise OrchestratorError(f"{op.name} failed: {exc}") from exc

    def _record(self, rec: OpRecord, ran: set[Op] | frozenset[Op] = frozenset()) -> None:
        """Record a finished op and release its children (`ran`: the ops of its fused run,
        which are recorded or requeued with the run, so never released here)."""
        op = rec.op
        self._records.append(rec)
        self._recorded.add(op)
        self.control.observed(rec.result)
        if self.on_op_done:
            self.on_op_done(rec)
        for c in self._children[op]:
            self._waiting[c] -= 1
            h = self._handle.get(c)
            if h is not None:
                self._running[h].pending.discard(op)
            elif self._waiting[c] == 0 and c not in self.skip and c not in ran:
                self._ready.append(c)

    def _ok(self, handle: Any) -> bool:
        ok = getattr(self.executor, "succeeded", None)
        return bool(ok(handle)) if ok is not None else False

    def _drop_chained(self, op: Op) -> None:
        """`op` is resubmitted: the ops chained on its lost run go back to waiting."""
        for c in self._children[op]:
            h = self._handle.get(c)
            if h is not None and op in self._running[h].pending:
                run = self._running.pop(h)
                self._unsubmit(h, run)
                self._cancel(h)

    def _cancel(self, handle: Any) -> None:
        cancel = getattr(self.executor, "cancel", None)
        if cancel is not None:
            cancel(handle)

    def _raise_if_memory(self, op: Op, since: float, exc: BaseException, fused: Sequence[Op] = ()) -> None:
        restarts_fn = getattr(self.executor, "memory_restarts", None)
        restarts = restarts_fn(since) if restarts_fn is not None else []
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
