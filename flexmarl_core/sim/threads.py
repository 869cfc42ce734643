"""In-process executor: ops run on threads standing in for workers, each with resource tags.

It runs the orchestrator without a cluster, for tests of the scheduling logic and for
single-process use. A "worker" here runs one op at a time, like a 1-thread Dask worker. It
chains and fuses ops as the Dask executor does (`executors/api.py` `ChainingExecutor`,
`FusingExecutor`), so the look-ahead and fusing run here too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

from flexmarl_core.control import OrchestratorError
from flexmarl_core.ops import FusedResult, Op, Route, StageResult, check_after
from flexmarl_core.stages import run_stage


class ThreadExecutor:
    """`fn(op, worker)` does the op's work on the worker thread; `stage_fn(run_dir)` gives
    the one that runs the real stages. A gradient helper's op (`Route.gradient_only`) is
    `fn(op, worker, gradient_only=True)`."""

    def __init__(self, fn: Callable[[Op, str], StageResult], workers: dict[str, dict[str, float]]) -> None:
        self.fn = fn
        self.resources = {w: dict(r) for w, r in workers.items()}
        self._busy: set[str] = set()  # workers running an op now
        self._free = threading.Condition()
        self.pool = ThreadPoolExecutor(max_workers=max(len(workers), 1) * 4)
        self._lock = threading.Lock()

    def _pick(self, route: Route) -> list[str]:
        if route.worker:
            return [route.worker]
        ok = [w for w, r in self.resources.items()
              if all(r.get(k, 0) >= v for k, v in route.resources.items())]
        if not ok:
            raise OrchestratorError(f"no worker has resources {route.resources}")
        return ok

    def _run(self, op: Op, candidates: list[str], after: Sequence[Future] = (),
             gradient_only: bool = False) -> StageResult:
        check_after(op, [f.result() for f in after])  # chained: start once those ended well
        with self._slot(candidates) as w:
            return self.fn(op, w, gradient_only=True) if gradient_only else self.fn(op, w)

    def _run_fused(self, ops: Sequence[Op], candidates: list[str], after: Sequence[Future] = ()) -> FusedResult:
        check_after(ops[0], [f.result() for f in after])
        with self._slot(candidates) as w:
            return FusedResult.run(ops, lambda op: self.fn(op, w))

    @contextmanager
    def _slot(self, candidates: list[str]) -> Iterator[str]:
        """The first free candidate (least-loaded placement), else whichever frees first (as a
        Dask task without a pinned worker goes to the worker that has room)."""
        with self._free:
            while (w := next((c for c in candidates if c not in self._busy), None)) is None:
                self._free.wait()
            self._busy.add(w)
        try:
            yield w
        finally:
            with self._free:
                self._busy.discard(w)
                self._free.notify_all()

    def submit(self, op: Op, route: Route, deps: Sequence[Op] = (), after: Sequence[Future] = ()) -> Future:
        return self.pool.submit(self._run, op, self._pick(route), after, route.gradient_only)

    def submit_fused(self, ops: Sequence[Op], route: Route, deps: Sequence[Sequence[Op]] = (),
                     after: Sequence[Future] = ()) -> Future:
        return self.pool.submit(self._run_fused, list(ops), self._pick(route), after)

    def cancel(self, handle: Future) -> None:
        handle.cancel()

    def succeeded(self, handle: Future) -> bool:
        return handle.done() and not handle.cancelled() and handle.exception() is None

    def wait_any(self, handles: Sequence[Future], timeout: float | None = None) -> list[Future]:
        done, _ = wait(list(handles), timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle: Future) -> StageResult | FusedResult:
        return handle.result()

    def now(self) -> float:
        return time.time()

    def worker_resources(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {w: dict(r) for w, r in self.resources.items()}

    def set_worker_resources(self, worker: str, resources: dict[str, float]) -> None:
        with self._lock:
            self.resources[worker].update(resources)

    def lost(self, exc: BaseException) -> bool:
        return False  # threads do not die on their own

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def stage_fn(run_dir: str) -> Callable[[Op, str], StageResult]:
    """The real stages of the run in `run_dir`, for `ThreadExecutor`."""
    return lambda op, worker, gradient_only=False: run_stage(str(run_dir), op, gradient_only=gradient_only)
