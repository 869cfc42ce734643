"""The orchestrator's executor on the real stack: Prefect task runs on a Dask cluster.

Routing is applied with `dask.annotate` around each submit, so the resource tag (and the
pinned worker, if any) is the one the router chose at that moment. Each task run records the
task runs of the ops it waited for as its upstream inputs, so the flow run's graph in the
Prefect UI is the MEG's iteration graph (rollout -> reward -> train -> step -> sync).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import dask
import distributed
from prefect.client.schemas.objects import TaskRunResult
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from flexmarl_core import cluster
from flexmarl_core.ops import MemoryRestart, Op, Route, StageResult
from tasks.lean import lean_submission, refresh_worker_settings
from tasks.stages import BY_KIND


class PrefectDaskExecutor:
    """Use as a context manager inside a flow run: `with PrefectDaskExecutor(address) as ex:`."""

    def __init__(self, address: str, run_dir: str, *, lean: bool = False) -> None:
        self.runner = DaskTaskRunner(address=address)
        self.run_dir = str(run_dir)
        self.lean = lean
        #: the task run of each op submitted in this flow run (the last one, if resubmitted)
        self.task_runs: dict[Op, Any] = {}
        self._stack = ExitStack()
        self._tags: tuple[float, dict[str, dict[str, float]]] | None = None

    def __enter__(self) -> PrefectDaskExecutor:
        self._stack.enter_context(self.runner)
        if self.lean:
            refresh_worker_settings(self.client)
            self._stack.enter_context(lean_submission())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)

    @property
    def client(self) -> distributed.Client:
        return self.runner.client

    def submit(self, op: Op, route: Route, deps: Sequence[Op] = ()) -> PrefectDaskFuture:
        task = BY_KIND[op.kind]
        # Ops finished by an earlier attempt (resume) have no task run in this flow run.
        upstream = {TaskRunResult(id=self.task_runs[d]) for d in deps if d in self.task_runs}
        annotations: dict[str, Any] = {}
        if route.resources:
            annotations["resources"] = route.resources
        if route.worker:
            annotations["workers"] = [route.worker]
        with dask.annotate(**annotations):
            # What DaskTaskRunner.submit does, with pure=False: every task run has a fresh id,
            # so hashing its arguments for a deterministic key is wasted work.
            future = self.client.submit(task, parameters={"run_dir": self.run_dir, "op": op},
                                        dependencies={"op": upstream}, return_type="state", pure=False)
        self.task_runs[op] = future.task_run_id
        return PrefectDaskFuture(wrapped_future=future, task_run_id=future.task_run_id)

    def wait_any(self, handles: Sequence[PrefectDaskFuture], timeout: float | None = None) -> list[Any]:
        by_dask = {h.wrapped_future: h for h in handles}
        done, _ = distributed.wait(list(by_dask), timeout=timeout, return_when="FIRST_COMPLETED")
        return [by_dask[f] for f in done]

    def result(self, handle: PrefectDaskFuture) -> StageResult:
        return handle.result()

    def now(self) -> float:
        return time.time()

    def worker_resources(self) -> dict[str, dict[str, float]]:
        # Tags change only when we re-tag (which invalidates) or a worker joins/leaves: a
        # short-lived cache saves a scheduler round trip per submission wave.
        now = time.monotonic()
        if self._tags is None or now - self._tags[0] > 1.0:
            tags = cluster.worker_resources(self.client)
            if not tags:  # a transient empty view (worker restarting) must not be cached
                return tags
            self._tags = (now, tags)
        return self._tags[1]

    def set_worker_resources(self, worker: str, resources: dict[str, float]) -> None:
        cluster.set_worker_resources(self.client, worker, resources)
        self._tags = None

    def memory_restarts(self, since: float) -> list[MemoryRestart]:
        return cluster.memory_restarts(self.client, since)

    def lost(self, exc: BaseException) -> bool:
        if cluster.lost_worker(exc):
            self._tags = None  # the worker set changed: route the resubmission on fresh tags
            return True
        return False
