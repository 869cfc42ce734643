"""The executor contract: what the orchestrator needs from a cluster, and the optional
capabilities it uses when an executor has them. Protocols only.

Implementations: `sim.threads.ThreadExecutor` (threads; chains and fuses), `cluster.DaskExecutor`
(plain Dask; chains, fuses, reports memory restarts, abandons hung ops), `tasks.executor.PrefectDaskExecutor` (the
real run: Dask plus Prefect task runs) and `sim.executor.SimExecutor` (a simulated clock; the
base contract only). The orchestrator checks a capability with `isinstance`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from flexmarl_core.ops import FusedResult, MemoryRestart, Op, Route, StageResult


@runtime_checkable
class Executor(Protocol):
    """Submit an op where its route says, wait for any to end, read its result."""

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


@runtime_checkable
class ChainingExecutor(Executor, Protocol):
    """Can start an op the moment the ops it is chained on end well (the look-ahead)."""

    def submit(self, op: Op, route: Route, deps: Sequence[Op], after: Sequence[Any] = ()) -> Any:
        """As `Executor.submit`; with `after` (handles of running ops) the op starts once those
        ended well, and fails with any of them that failed."""
        ...

    def cancel(self, handle: Any) -> None:
        """Forget a chained op whose dependency was lost (it goes back to waiting)."""
        ...

    def succeeded(self, handle: Any) -> bool:
        """Whether the op behind `handle` ended well (known without waiting)."""
        ...


@runtime_checkable
class FusingExecutor(Executor, Protocol):
    """Can run a chain of ops in order as one task (one dispatch for all)."""

    def submit_fused(self, ops: Sequence[Op], route: Route, deps: Sequence[Sequence[Op]],
                     after: Sequence[Any] = ()) -> Any:
        """Run `ops` in order where `route` says; `deps[i]` are `ops[i]`'s dependencies (see
        `Executor.submit`). The handle's result is a `FusedResult`."""
        ...


@runtime_checkable
class ReportsMemoryRestarts(Protocol):
    """Knows which workers were restarted for crossing their memory limit."""

    def memory_restarts(self, since: float) -> list[MemoryRestart]:
        """The workers restarted for memory since `since` (executor clock): a lost op with any
        fails as `WorkerMemoryError`, naming the knob that lowers its memory."""
        ...


@runtime_checkable
class AbandonsHungOps(Protocol):
    """Can give up on a running op that never returns: cancel it and restart its worker."""

    def running_on(self, handle: Any) -> str | None:
        """The worker running the op behind `handle` now; None while it waits for one."""
        ...

    def abandon(self, handle: Any, worker: str) -> str:
        """Cancel the op behind `handle` and restart `worker`, which runs it (a thread cannot
        be stopped, its process can); returns the worker's name."""
        ...


@runtime_checkable
class CountsWorkerCPU(Protocol):
    """Runs ops in worker processes of its own, whose CPU it can count."""

    def worker_cpu_s(self) -> float:
        """CPU seconds all its worker processes used so far (every thread)."""
        ...
