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
from flexmarl_core.ops import TRAINER_KINDS, MemoryRestart, Op, OpRecord, Route, StageResult
from flexmarl_core.plan import Plan

__all__ = ["LOST_WORKER_RESUBMITS", "Executor", "Orchestrator", "OrchestratorError", "RunResult",
           "WorkerMemoryError"]


class Executor(Protocol):
    """What the orchestrator needs from a cluster. Implementations: `executors.ThreadExecutor`,
    `cluster.DaskExecutor` (plain Dask), `tasks.executor.PrefectDaskExecutor` (the real run)."""

    def submit(self, op: Op, route: Route, deps: Sequence[Op]) -> Any:
        """Start `op` where `route` says; `deps` are the ops it waited for (already done),
        which an executor may record (the Prefect UI draws them as the graph's edges)."""
        ...

    def wait_any(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]: ...

    def result(self, handle: Any) -> StageResult: ...

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


#: How often one op is resubmitted after losing its worker before the run gives up.
LOST_WORKER_RESUBMITS = 3


class WorkerMemoryError(OrchestratorError):
    """An op's worker was restarted by Dask for crossing its memory limit: names the op, the
    agent, the worker and its limit, and the knob that lowers the op's memory."""

    def __init__(self, op: Op, restarts: Sequence[MemoryRestart]) -> None:
        self.op, self.restarts = op, list(restarts)
        first = self.restarts[0]
        hint = {
            "train": f"lower team.agents[{op.agent}].backend.train_chunk_tokens (or turn on "
                     "backend.activation_checkpointing)",
            "step": f"lower team.agents[{op.agent}].backend.train_chunk_tokens",
            "rollout": "lower batch.micro_batch_inputs or the agent's sampling.max_new_tokens",
        }.get(op.kind, "lower batch.micro_batch_inputs")
        super().__init__(
            f"{op.name} (agent {op.agent!r}) failed: Dask restarted its {first.describe()} for "
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


class Orchestrator:
    """Submits each op when its dependencies are done, with the route chosen at that moment."""

    def __init__(
        self,
        plan: Plan,
        cfg: ExperimentConfig,
        executor: Executor,
        *,
        on_op_done: Callable[[OpRecord], None] | None = None,
        skip: Iterable[Op] = (),
    ) -> None:
        self.plan = plan
        self.executor = executor
        self.control = ControlPlane(cfg, plan.meg.agent_names, executor.now)
        self.on_op_done = on_op_done
        #: ops an earlier attempt completed (resume): they count as done
        self.skip = set(skip)
        self.control.ledger.completed.update(self.skip)
        self._running: dict[Any, _Running] = {}
        self._order = self._late_binding_order(plan) if self.control.late_binding else None

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
        self._waiting = {op: sum(1 for d in ds if d not in skip) for op, ds in deps.items()}
        self._ready = [op for op, n in self._waiting.items() if n == 0 and op not in skip]
        #: one op per trainer at a time: its state lives in one worker's memory and accumulates
        self._trainer_busy: set[str] = set()
        self._resubmits: dict[Op, int] = defaultdict(int)
        self._running: dict[Any, _Running] = {}
        self._records: list[OpRecord] = []
        t0 = self.executor.now()
        total = sum(1 for op in deps if op not in skip)
        while len(self._records) < total:
            self._submit_ready()
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

    def _submit_ready(self) -> None:
        if not self._ready:
            return
        self._ready.sort(key=self._order)
        workers = self.control.place(
            self._ready, [(r.op, r.route) for r in self._running.values()], self._live_workers(),
            self.executor.set_worker_resources,
        )
        held = []
        # Late binding: while a reward runs, its train ops are about to want a worker; a
        # rollout started now would hold the one that is free for its whole length.
        rewards_pending = self._order is not None and any(
            o.kind == "reward" for o in [*self._ready, *(r.op for r in self._running.values())])
        for op in self._ready:
            if op.kind in TRAINER_KINDS and op.agent in self._trainer_busy:
                held.append(op)
                continue
            if op.kind == "rollout" and rewards_pending:
                held.append(op)
                continue
            route = self.control.route(op, workers)
            if route is None:  # late binding: no idle instance yet
                held.append(op)
                continue
            handle = self.executor.submit(op, route, [d for d in self.plan.deps[op] if d not in self.skip])
            self._running[handle] = _Running(op, self.executor.now(), route)
            self.control.submitted(op, route)
            if op.kind in TRAINER_KINDS:
                self._trainer_busy.add(op.agent)
        self._ready = held

    def _collect_finished(self) -> None:
        for handle in self.executor.wait_any(list(self._running)):
            run = self._running.pop(handle)
            op = run.op
            self.control.finished(op, run.route)
            if op.kind in TRAINER_KINDS:
                self._trainer_busy.discard(op.agent)
            try:
                res = self.executor.result(handle)
            except Exception as exc:
                lost = self.executor.lost(exc)
                if lost:
                    # A worker Dask restarted for memory will be restarted again for the same
                    # op: say so now, instead of the "no valid worker" timeout it ends in.
                    self._raise_if_memory(op, run.submitted, exc)
                if lost and self._resubmits[op] < LOST_WORKER_RESUBMITS:
                    # Its worker died: every stage is idempotent and rebuilds its engine or
                    # trainer from published weights / checkpoints, so run it again elsewhere.
                    self._resubmits[op] += 1
                    self.control.resubmitted(op, run.route, exc)
                    self._ready.append(op)
                    continue
                raise OrchestratorError(f"{op.name} failed: {exc}") from exc
            rec = OpRecord(op, run.submitted, self.executor.now(), res)
            self._records.append(rec)
            self.control.observed(res)
            if self.on_op_done:
                self.on_op_done(rec)
            for c in self._children[op]:
                self._waiting[c] -= 1
                if self._waiting[c] == 0 and c not in self.skip:
                    self._ready.append(c)

    def _raise_if_memory(self, op: Op, since: float, exc: BaseException) -> None:
        restarts_fn = getattr(self.executor, "memory_restarts", None)
        restarts = restarts_fn(since) if restarts_fn is not None else []
        if restarts:
            raise WorkerMemoryError(op, restarts) from exc

    def _live_workers(self, patience_s: float = 60.0) -> dict[str, dict[str, float]]:
        """Current worker tags. No workers at all means the cluster is (re)starting one, so
        wait for it; workers that lack a tag are a config error the router reports at once."""
        deadline = time.monotonic() + patience_s
        while True:
            workers = self.executor.worker_resources()
            if workers or time.monotonic() > deadline:
                return workers
            time.sleep(0.5)
