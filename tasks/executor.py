"""The orchestrator's executor on the real stack: ops as Dask tasks, reported as Prefect task runs.

Each op runs as a plain Dask task with the resources (and pinned worker) the router chose at
that moment (`cluster.DaskExecutor`), retried in the worker per its kind's `retries` (`flexmarl_core/ops.py` `KINDS`); the flow
process reports it as a task run of the current flow run whose upstream inputs are the task
runs of the ops it waited for, so the Prefect UI draws each iteration as the MEG's graph
(rollout -> reward -> train -> step -> sync). Why not one Prefect task per op: `tasks/task_runs.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Iterator, Sequence

import distributed
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

from flexmarl_core import cluster
from flexmarl_core.config import ExperimentConfig
from flexmarl_core.ops import FusedResult, Op, Route, StageResult, traits
from flexmarl_core.runfiles.location import shown
from tasks import lean, leftovers
from tasks.api_watch import ApiWatch
from tasks.iteration_runs import IterationFlowRuns
from tasks.task_runs import FLUSH_S, PENDING_AFTER_S, RETRY_DELAY_S, TaskRunReporter


class PrefectDaskExecutor(cluster.DaskExecutor):
    """Inside a flow run: `PrefectDaskExecutor(client, run_dir, flow_run_id, run_count)`."""

    def __init__(self, client: distributed.Client, run_dir: str, flow_run_id: uuid.UUID | str,
                 flow_run_count: int = 1, log: logging.Logger | logging.LoggerAdapter | None = None,
                 pending_after_s: float = PENDING_AFTER_S, flush_s: float = FLUSH_S,
                 iterations: IterationFlowRuns | None = None) -> None:
        super().__init__(client, run_dir, retry_delay_s=RETRY_DELAY_S)
        #: each iteration's nested flow run (None: the ops' task runs are the flow run's own)
        self.iterations = iterations
        #: how long the run's end waits for its API (`open_executor` sets the run's)
        self.api = iterations.api if iterations is not None else ApiWatch(None)
        self.reporter = TaskRunReporter(flow_run_id, flow_run_count, pending_after_s, flush_s, clock=self.now,
                                        flow_run_of=None if iterations is None else iterations.flow_run_id)
        self.log = log
        self._ops: dict[distributed.Future, Op] = {}
        self._fused: dict[distributed.Future, list[Op]] = {}

    @property
    def task_runs(self) -> dict[Op, uuid.UUID]:
        """The task run of each op submitted in this flow run (of the iterations not forgotten)."""
        return {op: run.id for op, run in self.reporter.runs.items()}

    def forget(self, below: int) -> None:
        """The orchestrator is done with the iterations before `below` (`ForgetsIterations`):
        their task runs and flow runs are no longer kept here, nor their task groups by Dask."""
        super().forget(below)
        self.reporter.forget(below)
        if self.iterations is not None:
            self.iterations.forget(below)

    def submit(self, op: Op, route: Route, deps: Sequence[Op] = (),
               after: Sequence[distributed.Future] = ()) -> distributed.Future:
        future = super().submit(op, route, deps, after)
        self._ops[future] = op
        # Ops finished by an earlier attempt (resume) have no task run here: no edge to them.
        self.reporter.submitted(op, list(deps), self.now())
        if self.iterations is not None:
            self.iterations.submitted(op, deps)
        return future

    def submit_fused(self, ops: Sequence[Op], route: Route, deps: Sequence[Sequence[Op]] = (),
                     after: Sequence[distributed.Future] = ()) -> distributed.Future:
        """A fused chain: one Dask task, one task run per op (each with its own edges)."""
        future = super().submit_fused(ops, route, deps, after)
        self._ops[future] = ops[0]
        self._fused[future] = list(ops)
        t = self.now()
        for op, ds in zip(ops, deps, strict=True):
            self.reporter.submitted(op, list(ds), t)
            if self.iterations is not None:
                self.iterations.submitted(op, ds)
        return future

    def wait_any(self, handles: Sequence[distributed.Future], timeout: float | None = None) -> list[distributed.Future]:
        """Wait as the plain executor does, reporting meanwhile what falls due (Pending for ops
        that run long, final states held back)."""
        deadline = None if timeout is None else self.now() + timeout
        while True:
            due = self.reporter.report_due(self.now())
            until = min((t for t in (due, deadline) if t is not None), default=None)
            done = super().wait_any(handles, None if until is None else max(until - self.now(), 0.0))
            if done or (deadline is not None and self.now() >= deadline):
                return done

    def cancel(self, handle: distributed.Future) -> None:
        """A chained op back to waiting: its task run stays, and counts its next run."""
        self._ops.pop(handle, None)
        self._fused.pop(handle, None)
        super().cancel(handle)

    def abandon(self, handle: distributed.Future, worker: str) -> str:
        """A hung op: its task run stays, and counts its next run."""
        self._ops.pop(handle, None)
        self._fused.pop(handle, None)
        return super().abandon(handle, worker)

    def result(self, handle: distributed.Future) -> StageResult | FusedResult:
        op = self._ops.pop(handle)
        fused = self._fused.pop(handle, None)
        try:
            res = super().result(handle)
        except Exception as exc:
            if not cluster.lost_worker(exc):  # a lost worker: the orchestrator resubmits the op
                for o in fused or [op]:  # a fused task that failed as a whole: none of its ops ran
                    self.reporter.failed(o, exc, self.now())
            raise
        for r in res.results if isinstance(res, FusedResult) else [res]:
            self._finished(r.op, r)
        if isinstance(res, FusedResult) and res.error is not None and fused is not None \
                and not cluster.lost_worker(res.error):
            self.reporter.failed(fused[len(res.results)], res.error, self.now())
        return res

    def _finished(self, op: Op, res: StageResult) -> None:
        self.reporter.finished(op, res)
        if res.retries and self.log is not None:
            for i, (_, _, err) in enumerate(res.retries, 1):
                self.log.warning("%s: attempt %d failed (%s); retried (%d/%d)", op.name, i, err, i, traits(op.kind).retries)


@contextlib.contextmanager
def open_executor(cfg: ExperimentConfig, flow_run_id: uuid.UUID | str, flow_run_count: int,
                  log: logging.Logger | logging.LoggerAdapter) -> Iterator[PrefectDaskExecutor]:
    """The run's cluster (a local one, or `cluster.address`) and an executor on it that
    reports each op as a task run of this flow run. Code in the workers that talks to Prefect
    itself (a custom reward) reports cheaply (`tasks/lean.py`) when the API is one flexmarl
    reaches directly. Dask's INFO lines go to the run's logs folder, not the terminal. On the
    way out the held-back reports are sent, whatever happened, the task runs and iteration
    flow runs still open end in the state that matches the run's (`tasks/leftovers.py`), within
    the run's budget for a silent API (`ex.api`, `tasks/api_watch.py`), and after a run that
    ended well the workers' names (by address, for the timeline) are written."""
    loc = cfg.run_location()
    scratch = loc.scratch_dir()
    api = PREFECT_API_URL.value()
    cheap = bool(api) and (cfg.cluster.prefect_lean is True or (
        cfg.cluster.prefect_lean == "auto" and cfg.cluster.address is None))
    log.info("run folder %s, store %s%s", shown(loc.uri), shown(cfg.resolved_store_uri()),
             "" if loc.local else f", local scratch {shown(scratch)}")
    with cluster.cluster_for(cfg.cluster) as client, get_client(sync_client=True) as api_client:
        if cfg.cluster.upload:  # before any task or plugin: the workers unpickle them with this code
            log.info("shipped to the workers: %s", cluster.upload_code(client, cfg.cluster.upload))
        if reach := lean.api_env(api, cheap=cheap, local=cfg.cluster.address is None):
            lean.refresh_worker_settings(client, reach)
        watch = ApiWatch(api)
        per = cfg.cluster.iterations_per_flow_run
        iterations = IterationFlowRuns(api_client, flow_run_id, flow_run_count, run_name=cfg.name,
                                       iterations=cfg.train.iterations, api=watch,
                                       per_flow_run=None if per == "auto" else per) if cfg.cluster.prefect_nested else None
        ex = PrefectDaskExecutor(client, loc.uri, flow_run_id, flow_run_count, log=log,
                                 pending_after_s=cfg.cluster.pending_after_s, flush_s=cfg.cluster.task_run_flush_s,
                                 iterations=iterations)
        ex.api = watch
        log.info("Dask dashboard: %s", client.dashboard_link)
        stop_logs = cluster.log_to_files(client, scratch / "logs", workers=cfg.cluster.address is None)
        names = cluster.worker_names(client)
        error: BaseException | None = None
        try:
            yield ex
        except BaseException as exc:
            error = exc
            raise
        finally:  # the final states held back, whether the run ended well or not
            watch.ended()
            ex.reporter.flush()
            type_ = leftovers.ending(error)
            ex.reporter.end(type_, type_.title(), leftovers.reason(type_, error), ex.now())
            if iterations is not None:
                iterations.close(error)
            ex.reporter.flush(final=True)
            stop_logs()
        names.update(cluster.worker_names(client))  # restarted workers have new addresses
    (scratch / "metrics" / "workers.json").write_text(json.dumps(names))
    if not loc.local:
        loc.upload(scratch / "metrics" / "workers.json", "metrics/workers.json")
