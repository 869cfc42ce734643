"""The stages' task runs: each op is one Prefect task run named by `Op.name`
(`rollout[solver] it=3 mb=2`), with the task runs of the ops it waited for as its upstream
inputs, so the flow run's graph in the Prefect UI is the MEG's iteration graph.

The op itself runs as a plain Dask task (`stages.run_stage_retrying`); the flow process
*reports* each task run to the API the way Prefect's client-side task engine does, with
`prefect.task-run.<State>` events on the events websocket, which the server's task-run
recorder turns into task runs and states (why: docs/decisions/task-run-reporting.md).

- An op that ends within `pending_after_s` (`cluster.pending_after_s`) of its submission is
  reported by one event, its final state with its start and end times, run count and upstream
  inputs; one still running then is reported Pending, so the UI shows long ops while they run.
- Final states of ops that went well are held back and sent together every `flush_s`
  (`cluster.task_run_flush_s`), so the server records them in one burst; anything else
  (Pending, a retry, a failure) goes at once, after everything held before it, so the API sees
  each task run's states in order. The flow flushes at its end whatever happened (`flush`).
- When the training flow stops, the task runs of ops still in flight (reported Pending) end
  in the state that matches the flow's, with its error as the reason (`end`): nothing is left
  Pending in the API.

Retries per kind below: rollouts and rewards are cheap to redo, a trainer op twice at most.
They run in the worker (no round trip), and each attempt shows in the API as a retry of that
task run (`run_count`, AwaitingRetry states with the error). Every stage is idempotent (the MEG
Store dedupes by sample id and policy version; train/step/sync check the trainer's version), so
a retry cannot duplicate work. A worker that dies is Dask's or the orchestrator's to rerun: the
same task run then counts one more run.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect.events import Event
from prefect.events.worker import EventsWorker

from flexmarl_core.ops import Op, StageResult, traits

#: seconds between a failed attempt and the next
RETRY_DELAY_S = 1.0
#: an op still running this long after its submission is reported Pending (see above)
PENDING_AFTER_S = 2.0
#: final states of ops that went well are sent together this often (see above)
FLUSH_S = 2.0
#: state types a task run does not leave
FINAL_TYPES = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat()


@dataclass
class _Run:
    id: uuid.UUID
    dynamic_key: str
    submitted: float
    inputs: list[dict[str, str]]
    run_count: int = 0
    start: float | None = None
    last_event: uuid.UUID | None = None
    tags: list[str] = field(default_factory=list)
    flow_run_id: str = ""
    #: its reports waiting for its flow run (`TaskRunReporter._deferred`)
    waiting: int = 0
    #: a final state of it was reported (or waits to be)
    final: bool = False


class TaskRunReporter:
    """Reports the ops of one flow run as its task runs (see the module docstring)."""

    def __init__(self, flow_run_id: uuid.UUID | str, flow_run_count: int = 1,
                 pending_after_s: float = PENDING_AFTER_S, flush_s: float = FLUSH_S,
                 clock: Callable[[], float] = time.time,
                 flow_run_of: Callable[[int], uuid.UUID | None] | None = None) -> None:
        self.flow_run_id = str(flow_run_id)
        #: iteration -> the flow run its ops' task runs belong to, None while it is being made
        #: (`iteration_runs.py`); unset: all in `flow_run_id`
        self.flow_run_of = flow_run_of
        #: reports of task runs whose flow run is not made yet, in order
        self._deferred: list[tuple[Op, _Run, float, str, str, str | None, dict[str, Any] | None]] = []
        self.flow_run_count = flow_run_count
        self.pending_after_s = pending_after_s
        self.flush_s = flush_s
        self._clock = clock
        #: final states held back, and when the oldest of them was held (see the docstring)
        self._held: list[Any] = []
        self._held_since = 0.0
        self._worker = EventsWorker.instance()
        self.runs: dict[Op, _Run] = {}
        #: ops submitted and not reported yet, oldest first
        self._unreported: dict[Op, _Run] = {}
        # The events worker attaches related resources from the caller's context (the flow
        # run's, with API reads); ours are explicit, so send from an empty context.
        self._ctx = contextvars.Context()

    def task_run_id(self, op: Op) -> uuid.UUID | None:
        run = self.runs.get(op)
        return run.id if run else None

    def forget(self, below: int) -> None:
        """Drop the task runs of ops of iterations before `below` (no op still to come waits
        for them) whose reports are all sent: the flow's memory stays flat."""
        self.runs = {op: run for op, run in self.runs.items()
                     if op.iteration >= below or run.waiting or op in self._unreported}

    def submitted(self, op: Op, deps: list[Op], t: float) -> None:
        if op in self.runs:  # resubmitted after losing its worker: the same task run, run again
            return
        # A flow-run retry starts its dynamic keys afresh; keep them apart from attempt 1's.
        key = op.name if self.flow_run_count <= 1 else f"{op.name} (flow run {self.flow_run_count})"
        inputs = [{"input_type": "task_run", "id": str(self.runs[d].id)} for d in deps if d in self.runs]
        run = _Run(uuid.uuid4(), key, t, inputs, tags=[op.kind])
        self.runs[op] = run
        if self.pending_after_s > 0:
            self._unreported[op] = run
        else:
            self._pending(op, run)

    def _owner(self, op: Op, run: _Run) -> bool:
        """Whether `run`'s flow run is known (its iteration's, once made)."""
        if not run.flow_run_id:
            owner = self.flow_run_id if self.flow_run_of is None else self.flow_run_of(op.iteration)
            run.flow_run_id = "" if owner is None else str(owner)
        return bool(run.flow_run_id)

    def _drain(self, *, final: bool = False) -> None:
        """Send the deferred reports whose flow run is made now (`final`: the rest into the
        training run's flow run: the API never made theirs)."""
        if not self._deferred:
            return
        # Taken first: a send flushes what is held, which drains again (nothing left to do).
        items, self._deferred = self._deferred, []
        waiting, stuck = [], set()  # a run whose report stays waits whole: its states in order
        for item in items:
            op, run = item[0], item[1]
            if final and not self._owner(op, run):
                run.flow_run_id = self.flow_run_id
            if id(run) not in stuck and self._owner(op, run):
                run.waiting -= 1
                self._send(*item)
            else:
                stuck.add(id(run))
                waiting.append(item)
        self._deferred = waiting + self._deferred

    def report_due(self, now: float) -> float | None:
        """Report what is due at `now` (the flow's clock): Pending for the ops submitted at
        least `pending_after_s` before, the held final states once `flush_s` old; when the next
        report falls due (None: nothing waits)."""
        self._drain()
        due: float | None = now + 0.5 if self._deferred else None
        while self._unreported:
            op, run = next(iter(self._unreported.items()))
            if run.submitted + self.pending_after_s > now:
                due = run.submitted + self.pending_after_s
                break
            self._pending(op, run)
        if self._held:
            if now >= self._held_since + self.flush_s:
                self.flush()
            else:
                due = min(due if due is not None else math.inf, self._held_since + self.flush_s)
        return due

    def flush(self, *, final: bool = False) -> None:
        """Send every final state held back (`final`: and every report still waiting for its
        iteration's flow run, into the training run's)."""
        self._drain(final=final)
        held, self._held = self._held, []
        for event in held:
            self._ctx.run(self._worker.send, event)

    def _pending(self, op: Op, run: _Run) -> None:
        self._unreported.pop(op, None)
        self._emit(op, run, run.submitted, "PENDING", "Pending")

    def finished(self, op: Op, res: StageResult) -> None:
        """`op` ended well in `res`: its failed attempts, then Completed (its start time and
        run count in the task run; a Running state of its own would cost the server a third
        more work per op for a state nobody sees on ops this short)."""
        run = self.runs[op]
        self._unreported.pop(op, None)
        for t0, t1, err in res.retries:
            self._attempt(op, run, t0, t1, err, last=False)
        run.run_count += 1
        run.start = run.start if run.start is not None else res.t_start
        self._emit(op, run, res.t_end, "COMPLETED", "Completed")

    def failed(self, op: Op, exc: BaseException, t: float) -> None:
        """`op` failed for good (its retries are spent): every attempt, the last one Failed."""
        run = self.runs[op]
        self._unreported.pop(op, None)
        attempts = getattr(exc, "flexmarl_attempts", None) or [[run.start or run.submitted, t, repr(exc)]]
        for i, (t0, t1, err) in enumerate(attempts):
            self._attempt(op, run, t0, t1, err, last=i == len(attempts) - 1)

    def _attempt(self, op: Op, run: _Run, t0: float, t1: float, err: str, *, last: bool) -> None:
        self._running(op, run, t0)
        if last:
            self._emit(op, run, t1, "FAILED", "Failed", message=f"Task run failed: {err}")
        else:
            self._emit(op, run, t1, "SCHEDULED", "AwaitingRetry",
                       message=f"Retry {run.run_count}/{traits(op.kind).retries}: {err}",
                       details={"scheduled_time": _iso(t1 + RETRY_DELAY_S)})

    def _running(self, op: Op, run: _Run, t: float) -> None:
        run.run_count += 1
        run.start = run.start if run.start is not None else t
        self._emit(op, run, t, "RUNNING", "Running")

    def end(self, type_: str, name: str, message: str, t: float) -> int:
        """The flow stops: every task run reported and not final ends in `type_` (`name`)
        with `message` at `t`; how many. Ops submitted but not reported yet stay unreported."""
        self._unreported.clear()
        left = [(op, run) for op, run in self.runs.items() if run.last_event is not None or run.waiting]
        n = 0
        for op, run in left:
            if not run.final:
                self._emit(op, run, t, type_, name, message=message)
                n += 1
        return n

    def _emit(self, op: Op, run: _Run, t: float, type_: str, name: str, *, message: str | None = None,
              details: dict[str, Any] | None = None) -> None:
        if type_ in FINAL_TYPES:
            run.final = True
        self._drain()  # what waited goes first: the API sees each task run's states in order
        if run.waiting or not self._owner(op, run):
            run.waiting += 1
            self._deferred.append((op, run, t, type_, name, message, details))
            return
        self._send(op, run, t, type_, name, message, details)

    def _send(self, op: Op, run: _Run, t: float, type_: str, name: str, message: str | None,
              details: dict[str, Any] | None) -> None:
        final = type_ in FINAL_TYPES
        task_run = {
            "name": op.name, "task_key": f"flexmarl-{op.kind}", "dynamic_key": run.dynamic_key,
            "empirical_policy": {"retries": traits(op.kind).retries, "retry_delay": RETRY_DELAY_S},
            "tags": run.tags, "labels": {}, "task_inputs": {"op": run.inputs},
            "run_count": run.run_count, "flow_run_run_count": self.flow_run_count,
            "expected_start_time": _iso(run.submitted),
        }
        if run.start is not None:
            task_run["start_time"] = _iso(run.start)
        if final and run.start is not None:
            task_run["end_time"] = _iso(t)
            task_run["total_run_time"] = max(t - run.start, 0.0)
        state = {"type": type_, "name": name, "message": message or "", "state_details": details or {}}
        event = Event(
            id=uuid.uuid4(), occurred=dt.datetime.fromtimestamp(t, dt.UTC),
            event=f"prefect.task-run.{name}",
            resource={"prefect.resource.id": f"prefect.task-run.{run.id}", "prefect.resource.name": op.name,
                      "prefect.run-count": str(run.run_count), "prefect.state-name": name,
                      "prefect.state-type": type_, "prefect.orchestration": "client"},
            related=[{"prefect.resource.id": f"prefect.flow-run.{run.flow_run_id}",
                      "prefect.resource.role": "flow-run"},
                     *({"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"}
                       for tag in run.tags)],
            payload={"intended": {"to": type_}, "validated_state": {**state, "data": None}, "task_run": task_run},
            follows=run.last_event,
        )
        run.last_event = event.id
        if type_ == "COMPLETED" and self.flush_s > 0:
            if not self._held:
                self._held_since = self._clock()
            self._held.append(event)
            if self._clock() >= self._held_since + self.flush_s:
                self.flush()
            return
        self.flush()  # what was held goes first: the API sees each task run's states in order
        self._ctx.run(self._worker.send, event)
