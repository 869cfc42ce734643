"""`DaskExecutor`: the orchestrator's ops as plain Dask tasks, on the worker the router chose."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import distributed
from distributed import Client
from distributed.client import CancelledError

from flexmarl_core.cluster.plugins import DaskPrograms, DaskWeightPushes
from flexmarl_core.cluster.workers import (
    WorkerLeftError,
    lost_worker,
    memory_restarts,
    set_worker_resources,
    worker_cpu_s,
    worker_names,
    worker_resources,
)
from flexmarl_core.control import OrchestratorError
from flexmarl_core.ops import KINDS, FusedResult, MemoryRestart, Op, Route, StageResult, traits
from flexmarl_core.stages import run_fused, run_stage_after, run_stage_retrying

log = logging.getLogger(__name__)


def _executing(dask_worker: Any) -> list[str]:
    """Keys of the tasks a worker's threads run now (seceded ones too)."""
    state = dask_worker.state
    return [ts.key for ts in (*state.executing, *state.long_running)]


def _drop_forgotten_groups(dask_scheduler: Any) -> int:
    """Runs on the scheduler. A task group is dropped from the scheduler once its last task is
    forgotten, but its span and its computation keep it for good (distributed's spans.py says
    so). Ops run a few at a time, so each group empties and is made anew: one group kept per op,
    ~2 KB each in the scheduler's process (the flow's, on a local cluster). Only flexmarl's
    groups (`dask_key`) are dropped; the dashboard's totals for them go with them."""
    live = dask_scheduler.task_groups
    spans = dask_scheduler.extensions.get("spans")
    holders = [*(spans.spans.values() if spans is not None else ()), *dask_scheduler.computations]
    dropped = 0
    for holder in holders:
        gone = {tg for tg in holder.groups
                if live.get(tg.name) is not tg and _ours(tg.name)}
        holder.groups -= gone
        dropped += len(gone)
    return dropped


def _ours(group: str) -> bool:
    """A task group of flexmarl's ops (`dask_key`) or of a program op's decodes."""
    return group.split("[", 1)[0].split("+", 1)[0] in KINDS or group.startswith("decode-")


def dask_key(op: Op, *, fused: int = 0) -> str:
    """`op`'s Dask key, `rollout[solver]-it3-mb2-1a2b3c4d` (`+2` after the kind: a fused run
    of three). Dask names a task's prefix and group by the key's words up to the numbers and
    hex, so these stay one per kind and agent: a prefix per op name (`it=3 mb=2`) was kept by
    the scheduler for the whole run, ~2 KB per op in the flow process."""
    head = f"{op.kind}[{op.agent}]" if op.agent else op.kind
    return f"{head}{f'+{fused}' if fused else ''}-it{op.iteration}-mb{op.mb}-{os.urandom(4).hex()}"


class SchedulerLostError(OrchestratorError):
    """The client lost the Dask scheduler mid-run: every op in flight is gone with it."""


#: how long a hung op's worker may take to restart before the run goes on without waiting
RESTART_TIMEOUT_S = 60.0
#: how often a wait looks for workers that left while ops are pinned to them
LEFT_POLL_S = 0.5


class DaskExecutor:
    """Runs ops as plain Dask tasks: `stages.run_stage_retrying(run_dir, op, ...)` on the worker
    the route names, each op tried up to 1 + its kind's `retries` times there (`ops.KINDS`); it chains, fuses,
    reports memory restarts and abandons hung ops (`executors/api.py`). The real run's executor
    (`tasks/executor.py`) adds the Prefect task runs on top."""

    def __init__(self, client: Client, run_dir: str, *, retry_delay_s: float = 1.0) -> None:
        self.client = client
        self.run_dir = str(run_dir)
        self.retry_delay_s = retry_delay_s
        self._tags: tuple[float, dict[str, dict[str, float]]] | None = None
        self._drop_groups = True  # `forget`: until the scheduler refuses it
        self._pinned: dict[str, str] = {}  # key -> the worker its route names
        self._left: dict[str, WorkerLeftError] = {}  # key -> why it was given back
        self._dep_pins: dict[str, list[str]] = {}  # key -> the workers its dependencies are pinned to
        self._next_look = 0.0  # monotonic time of the next look for workers that left
        client.register_plugin(DaskWeightPushes())  # before any op: syncs push, rollouts take
        client.register_plugin(DaskPrograms())  # program ops secede and decode on instances

    def submit(self, op: Op, route: Route, deps: Sequence[Op] = (),
               after: Sequence[distributed.Future] = ()) -> distributed.Future:
        """`after`: futures of the ops `op` is chained on. Dask runs it once they are done (their
        results, small `StageResult`s, are its ignored arguments); if one fails, so does it.

        Ops queued on one worker run oldest iteration first (Dask's `priority`): with
        `max_staleness` or the async pipeline, rollouts of the next iteration are ready early,
        and one that jumped ahead would hold back the training the current iteration waits on."""
        return self.track(route, after, self.client.submit(
            run_stage_after if after else run_stage_retrying,
            self.run_dir, op, traits(op.kind).retries, self.retry_delay_s, *after,
            gradient_only=route.gradient_only,
            key=dask_key(op),
            resources=route.resources or None,
            workers=[route.worker] if route.worker else None,
            priority=-op.iteration,  # a worker runs an older iteration's queued op first
            pure=False,
        ))

    def submit_fused(self, ops: Sequence[Op], route: Route, deps: Sequence[Sequence[Op]] = (),
                     after: Sequence[distributed.Future] = ()) -> distributed.Future:
        """One Dask task running `ops` in order where `route` says (`stages.run_fused`); its
        result is a `FusedResult`. `deps`: each op's dependencies (see `submit`)."""
        return self.track(route, after, self.client.submit(
            run_fused, self.run_dir, list(ops), [traits(op.kind).retries for op in ops],
            self.retry_delay_s, *after,
            key=dask_key(ops[0], fused=len(ops) - 1),
            resources=route.resources or None,
            workers=[route.worker] if route.worker else None,
            priority=-ops[0].iteration,
            pure=False,
        ))

    def track(self, route: Route, after: Sequence[distributed.Future],
              future: distributed.Future) -> distributed.Future:
        """Note where `future` is pinned, and where the ops it is chained on are: Dask moves a
        dependency's result to the op's worker before it runs, and one whose worker left is
        run again where it is pinned, even after the orchestrator has fetched it. `submit` and
        `submit_fused` call it; a task submitted to the client directly (`route` and `after` as
        it was given them) is then given back as lost, by `wait_any` and `result`, like an op."""
        if route.worker:
            self._pinned[future.key] = route.worker
        if held := [w for f in after if (w := self._pinned.get(f.key))]:
            self._dep_pins[future.key] = held
        return future

    def _unpin(self, key: str) -> None:
        self._dep_pins.pop(key, None)
        self._pinned.pop(key, None)

    def _watched(self, key: str) -> bool:
        """Whether a worker leaving can strand the op (`_gone` looks for it)."""
        return key in self._pinned or key in self._dep_pins

    def forget(self, below: int) -> None:
        """The orchestrator is done with the iterations before `below` (`ForgetsIterations`):
        the scheduler lets go of the task groups of our ops it has forgotten."""
        if not self._drop_groups:
            return
        try:
            self.client.run_on_scheduler(_drop_forgotten_groups)
        except Exception as exc:  # a scheduler that runs no functions: memory hygiene only
            self._drop_groups = False
            log.warning("the Dask scheduler kept its finished task groups (%s: %s)", type(exc).__name__, exc)

    def cancel(self, handle: distributed.Future) -> None:
        self._unpin(handle.key)
        self._left.pop(handle.key, None)
        handle.cancel()

    def running_on(self, handle: distributed.Future) -> str | None:
        """The worker executing the op now. The scheduler's `processing` also lists tasks
        queued on a worker behind others (a hung op holds its worker's thread): the worker
        itself says which run."""
        addr = next((a for a, keys in self.client.processing().items() if handle.key in keys), None)
        if addr is None:
            return None
        try:
            running = self.client.run(_executing, workers=[addr]).get(addr, [])
        except (OSError, KeyError):  # gone meanwhile: lost, which its result will say
            return None
        return addr if handle.key in running else None

    def abandon(self, handle: distributed.Future, worker: str) -> str:
        """Cancel a hung op and restart (through its Nanny) the worker running it: the thread
        that never returns goes with its process. Other ops on that worker are lost with it
        and resubmitted as after any worker death."""
        name = worker_names(self.client).get(worker, worker)
        self._unpin(handle.key)
        handle.cancel()
        self.client.restart_workers([worker], timeout=RESTART_TIMEOUT_S, raise_for_error=False)
        self._tags = None  # it comes back at a new address
        return name

    def succeeded(self, handle: distributed.Future) -> bool:
        return handle.status == "finished"

    def wait_any(self, handles: Sequence[distributed.Future], timeout: float | None = None) -> list[Any]:
        """The handles done within `timeout`, or those pinned to a worker that left (given
        back as lost: `result` raises `WorkerLeftError`). Dask would hold such an op until its
        no-workers timeout (15 s of a stalled run per dead worker): the wait looks for them
        every `LEFT_POLL_S`."""
        pinned = [h for h in handles if self._watched(h.key)]
        if not pinned:
            return self._wait(handles, timeout)
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            step = LEFT_POLL_S if until is None else min(LEFT_POLL_S, max(until - time.monotonic(), 0.0))
            done = self._wait(handles, step)
            # Look while other ops keep finishing too: a run whose other ops end every few
            # hundred ms would otherwise never look, and its lost op would wait out the timeout.
            if (now := time.monotonic()) >= self._next_look:
                self._next_look = now + LEFT_POLL_S
                done += [h for h in self._gone(pinned) if h not in done]
            if done:
                return done
            if until is not None and time.monotonic() >= until:
                return []

    def _wait(self, handles: Sequence[distributed.Future], timeout: float | None) -> list[Any]:
        try:
            done, _ = distributed.wait(list(handles), timeout=timeout, return_when="FIRST_COMPLETED")
        except TimeoutError:  # Dask raises where concurrent.futures returns nothing done
            return []
        except CancelledError as exc:
            self._check_scheduler(exc)
            raise
        return list(done)

    def _gone(self, pinned: Sequence[distributed.Future]) -> list[distributed.Future]:
        """The pinned handles whose worker, or a worker that held a result they are chained
        on, is no longer in the cluster, cancelled."""
        self._check_scheduler()  # a lost scheduler is the run's end, not every op's worker
        try:
            live = self.worker_resources()
        except OSError as exc:  # the scheduler went just now: the next wait says so
            self._check_scheduler(exc)
            return []
        if not live:  # no worker at all (all restarting): Dask's no-workers timeout decides
            return []
        # also "lost": finished, but its result lived only on the worker that left
        gone = []
        for h in pinned:
            if h.status in ("finished", "error", "cancelled"):
                continue
            if (worker := self._pinned.get(h.key)) is not None and worker not in live:
                why = f"worker {worker} left the cluster before {h.key} ended"
            elif left := [w for w in self._dep_pins.get(h.key, ()) if w not in live]:
                why = f"worker {left[0]} left the cluster holding a result {h.key} is chained on"
            else:
                continue
            self._unpin(h.key)
            self._left[h.key] = WorkerLeftError(why)
            h.cancel()
            gone.append(h)
        return gone

    def result(self, handle: distributed.Future) -> StageResult | FusedResult:
        """A done op's result. Its result lives on the worker that ran it: if that worker left
        before the result was fetched, Dask would run the op again where it is pinned, an address
        no worker has, and hold the fetch until its no-workers timeout. The fetch waits in
        `LEFT_POLL_S` slices and looks (`_gone`) between them."""
        slow = 0  # slices timed out with the op finished and its worker still in the view
        try:
            while self._watched(handle.key):
                try:
                    return handle.result(timeout=LEFT_POLL_S)
                except TimeoutError:
                    if handle.status == "error":  # failed just now: its own error, below
                        break
                    slow += handle.status == "finished"
                    if slow >= 3 or self._gone([handle]):
                        break  # on a live worker a slow fetch still ends; a gone op raises below
            if (left := self._left.pop(handle.key, None)) is not None:
                raise left
            return handle.result()
        except CancelledError as exc:
            self._check_scheduler(exc)
            raise
        finally:
            self._unpin(handle.key)

    def _check_scheduler(self, exc: BaseException | None = None) -> None:
        """Dask cancels every future when its client loses the scheduler, and the scheduler's
        task state is gone with it: the run stops, saying how to resume."""
        if self.client.status == "running" and "scheduler-connection-lost" not in str(exc or ""):
            return
        address = getattr(self.client.scheduler, "address", "")
        raise SchedulerLostError(
            f"lost the Dask scheduler {address} mid-run: start it and its workers again, then "
            f"`flexmarl train --resume {self.run_dir}` (finished ops are kept)") from exc
    def now(self) -> float:
        return time.time()

    def worker_resources(self) -> dict[str, dict[str, float]]:
        # Tags change only when we re-tag (which invalidates) or a worker joins/leaves: a
        # short-lived cache saves a scheduler round trip per submission wave.
        now = time.monotonic()
        if self._tags is None or now - self._tags[0] > 1.0:
            tags = worker_resources(self.client)
            if not tags:  # a transient empty view (worker restarting) must not be cached
                return tags
            self._tags = (now, tags)
        return self._tags[1]

    def set_worker_resources(self, worker: str, resources: dict[str, float]) -> None:
        set_worker_resources(self.client, worker, resources)
        self._tags = None

    def lost(self, exc: BaseException) -> bool:
        self._check_scheduler()
        if lost_worker(exc):
            self._tags = None  # the worker set changed: route the resubmission on fresh tags
            return True
        return False

    def worker_cpu_s(self) -> float:
        return worker_cpu_s(self.client)

    def memory_restarts(self, since: float) -> list[MemoryRestart]:
        try:
            return memory_restarts(self.client, since)
        except OSError as exc:  # a comm that cannot reach the scheduler (CommClosedError too)
            self._check_scheduler(exc)
            raise
