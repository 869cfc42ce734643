"""The training run's iterations as flow runs nested under its own.

The Prefect server draws a flow run's graph only up to 10,000 task runs, and a run of the
default team has ~35 ops per iteration, so one flat flow run stops drawing at iteration ~290.
Here the training run's flow run holds one task run per nested flow run, and that task run is
the parent of a flow run of its own (`flexmarl-iteration`), which holds the op task runs of its
iterations (`tasks/task_runs.py`): every graph stays small, and the parent lists them (each
with the previous one as its upstream input), as a subflow call would draw them. Both are named
after the run, `arith-tiny it 3`, or `arith-tiny it 3-40` for one that holds several
iterations (a flow-run retry's "arith-tiny it 3 (flow run 2)"), and tagged with the run's name.

How many iterations a nested flow run holds (`cluster.iterations_per_flow_run`): a number, or
`auto`, one each until the run's pace is known, then as many as the attempt makes in `BLOCK_S`
seconds at its pace so far (at most `MAX_BLOCK`), so that each costs the API a few calls per
5 s of the run however short its iterations: on a run of 0.1-0.2 s iterations, a flow run per
iteration cost the local server ~50 ms of CPU each, a quarter of the run's wall time on two
cores (docs/results/overhead.md). Ops of one flow run draw their edges across its iterations.

A flow run is asked for when the first op of its first iteration is submitted and set
Completed when its last iteration is final (its metrics row emitted), or, where the run went
past iterations it spans (a resumed attempt's skipped ones), when those it holds are. It
carries its record: each iteration's line and decisions in its logs, their ops and figures in
an artifact, and the ops of other flow runs they waited for (`tasks/iteration_record.py`). One
still open when the training flow stops gets the record of its final iterations and ends in
the state that matches the flow's (Completed, Failed, Crashed or Cancelled,
`tasks/leftovers.py`) with the flow's error as the reason.

The API calls run on a thread of their own, flow-run creations first: the orchestrator never
waits for the API, and an API server that is away delays only the reports (the op task runs of
an iteration whose flow run does not exist yet wait in the reporter, `flow_run_id` answering
None until it does). Each call costs the local server 8-25 ms of CPU, which on a machine the
workers fill comes out of the stages, so they are few: at most five per nested flow run. The
flow's id is asked for once, not with every flow run; the tracking task run takes each state of
its flow run from the server itself (Prefect's `UpdateSubflowParentTask` rule), never by a call
of its own; and flow runs that end within `end_lag_s` of each other are recorded together,
their log lines in one call (`calls` counts the calls by kind). Each call is tried once per
`RETRY_S` for as long as the run goes; once it ends, the run's one budget for a silent API
applies (`tasks/api_watch.py`), however many calls are queued.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from prefect import Flow, Task
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import ArtifactCreate, FlowRunCreate, LogCreate
from prefect.client.schemas.objects import FlowRunPolicy, TaskRunResult
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_CLIENT_MAX_RETRIES,
    PREFECT_LOGGING_TO_API_ENABLED,
    temporary_settings,
)
from prefect.states import Running, to_state_create

from flexmarl_core.control import Decision
from flexmarl_core.ops import Op, OpRecord
from flexmarl_core.orchestrator.hooks import RunHook
from tasks import iteration_record, leftovers
from tasks.api_watch import ApiWatch

__all__ = ["ITERATION_FLOW", "TRACKING_KEY", "IterationFlowRuns"]

log = logging.getLogger(__name__)


def _iteration(iteration: int, last: int | None = None) -> None:
    """One or more training iterations' ops, `iteration` to `last` (made by the training flow,
    never called)."""


#: the flow the iterations' flow runs belong to (registered by name on first use)
ITERATION_FLOW: Flow[Any, Any] = Flow(_iteration, name="flexmarl-iteration")
_TRACKING = Task(_iteration, name="flexmarl-iteration")
#: the `task_key` of the iterations' task runs in the training run's flow run
TRACKING_KEY = _TRACKING.task_key
#: seconds between two tries of an API call that failed
RETRY_S = 2.0
#: a flow run's record waits this long for the ends of the next ones, sent together
END_LAG_S = 1.0
#: `auto`: a nested flow run holds the iterations the run makes in this many seconds
BLOCK_S = 5.0
#: `auto`: at most this many iterations in one nested flow run (its graph stays small)
MAX_BLOCK = 100
#: `auto`: the pace is known once this many iterations of the attempt have ended
PACE_ENDS = 3


def block_size(ends: int, span_s: float, target_s: float = BLOCK_S, cap: int = MAX_BLOCK) -> int:
    """How many iterations the next nested flow run holds under `auto`: one until `PACE_ENDS`
    iterations have ended, then as many as end in `target_s` at the attempt's pace so far:
    `ends` iterations in `span_s`, from its first op's submission to the last end. Taken over
    the whole attempt, not the last few ends: rows that become final together (held behind an
    older op) would make a pace of zero."""
    if ends < PACE_ENDS or span_s <= 0:
        return 1
    return max(1, min(cap, math.ceil(target_s * ends / span_s)))


class IterationFlowRuns(RunHook):
    """The nested flow runs of a training flow run's iterations (see the module docstring); as
    a run hook, it gathers each iteration's ops and decisions, and completes a flow run once the
    metrics rows of its iterations are final. `per_flow_run`: iterations per nested flow run
    (None: `auto`)."""

    def __init__(self, client: SyncPrefectClient, parent_flow_run_id: uuid.UUID | str,
                 flow_run_count: int = 1, run_name: str = "", iterations: int = 0,
                 api: ApiWatch | None = None, end_lag_s: float = END_LAG_S,
                 per_flow_run: int | None = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.parent = uuid.UUID(str(parent_flow_run_id))
        self.flow_run_count = flow_run_count
        self.run_name = run_name
        #: iterations in the run (the logged lines count them from 1)
        self.iterations = iterations
        self.api = api if api is not None else ApiWatch(None)
        self.end_lag_s = end_lag_s
        self.per_flow_run = per_flow_run
        self._clock = clock
        #: API calls made, by kind (`open`, `logs`, `artifact`, `state`)
        self.calls: collections.Counter[str] = collections.Counter()
        self._flow_id: uuid.UUID | None = None
        # A nested flow run is keyed by its first iteration (a "block"): the iterations it holds
        # and, once made, its task run in the parent and its own id.
        self._block: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._newest: int | None = None
        #: block -> the iterations in it so far; blocks the run has gone past (a later one began)
        self._members: dict[int, set[int]] = {}
        self._passed: set[int] = set()
        # The attempt's pace: its first op's submission, its iterations ended since, the last end.
        self._t0: float | None = None
        self._ends = 0
        self._t_end = 0.0
        #: block -> (its task run in the parent, its own flow run), once made
        self.runs: dict[int, tuple[uuid.UUID, uuid.UUID]] = {}
        self._asked: set[int] = set()
        #: blocks whose runs the API thread set Completed (it adds, `forget` removes)
        self._ended: set[int] = set()
        # Gathered on the orchestrator's thread (appends only), handed over at the block's end.
        self._ops: dict[int, list[OpRecord]] = {}
        self._waited: dict[int, dict[str, list[str]]] = {}
        self._where: dict[int, dict[int, str]] = {}
        self._decided: dict[int, list[Decision]] = {}
        self._seen = 0
        #: rows final, whose iteration's last op has yet to reach this hook (`iteration_done`)
        self._rows: dict[int, dict[str, Any]] = {}
        #: iterations whose record is made: what comes for them later (a rerun op) is not kept
        self._recorded: set[int] = set()
        #: block -> the records of its iterations that are final, until all of them are
        self._final: dict[int, dict[int, iteration_record.IterationRecord | None]] = {}
        # Work for the API thread: flow-run creations go before everything else.
        self._opens: collections.deque[tuple[str, int, Any]] = collections.deque()
        self._rest: collections.deque[tuple[str, int, Any]] = collections.deque()
        self._wake = threading.Condition()
        self._last_tracking: uuid.UUID | None = None
        # A thread starts without the flow's settings context: it gets the flow's API (else a
        # call that emits an event, as an artifact's creation does, would start a temporary
        # server of its own) and tries each call once (`_call` retries).
        self._settings = {PREFECT_API_URL: PREFECT_API_URL.value(), PREFECT_CLIENT_MAX_RETRIES: 0}
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="flexmarl-iteration-runs", daemon=True)
        self._thread.start()

    def _name(self, block: int) -> str:
        last = self._last.get(block, block)
        its = f"{block}" if last == block else f"{block}-{last}"
        run = f"{self.run_name} it {its}" if self.run_name else f"iteration {its}"
        return run + ("" if self.flow_run_count <= 1 else f" (flow run {self.flow_run_count})")

    # -- the flow's thread ---------------------------------------------------------------------
    def block(self, iteration: int) -> int:
        """The first iteration of the nested flow run that holds `iteration`: the newest one's
        if it spans it, else a new one from `iteration` on (sized by `per_flow_run`, or the pace
        under `auto`), past which the run has then gone; an iteration older than the newest
        flow run that none holds (a resumed attempt's) gets one of its own."""
        got = self._block.get(iteration)
        if got is not None:
            return got
        if self._t0 is None:
            self._t0 = self._clock()
        newest = self._newest
        if newest is not None and newest <= iteration <= self._last.get(newest, newest):
            got = newest
        else:
            got = iteration
            size = 1
            if newest is None or iteration > self._last.get(newest, newest):
                size = self.per_flow_run or block_size(self._ends, self._t_end - self._t0)
                self._newest = iteration
            last = iteration + size - 1
            self._last[iteration] = max(iteration, min(last, self.iterations - 1) if self.iterations else last)
            if newest is not None and got == self._newest:
                self._pass(newest)
        self._block[iteration] = got
        self._members.setdefault(got, set()).add(iteration)
        return got

    def _pass(self, block: int) -> None:
        """The run has gone past `block`: it takes no more iterations (those of its span that
        never came, a resumed attempt's skipped ones, are not waited for)."""
        self._passed.add(block)
        self._end_if_final(block)

    def _end_if_final(self, block: int) -> None:
        """Hand `block` over for its record and Completed state once every iteration in it is
        final and it takes no more (its span full, or passed)."""
        final = self._final.get(block)
        members = self._members.get(block, set())
        if final is None or len(final) < len(members):
            return
        if len(members) > self._last.get(block, block) - block or block in self._passed:
            self._passed.discard(block)
            self._put(("end", block, (self._final.pop(block), True)))

    def flow_run_id(self, iteration: int) -> uuid.UUID | None:
        """The flow run that holds `iteration`'s ops, or None while it is being made (asked
        for on the first call)."""
        block = self.block(iteration)
        got = self.runs.get(block)
        if got is not None:
            return got[1]
        self._ask(block)
        return None

    def _put(self, item: tuple[str, int, Any]) -> None:
        with self._wake:
            (self._opens if item[0] == "open" else self._rest).append(item)
            self._wake.notify()

    def _ask(self, block: int) -> None:
        if block not in self._asked:
            self._asked.add(block)
            self._put(("open", block, None))

    def submitted(self, op: Op, deps: Sequence[Op]) -> None:
        """`op` was submitted after `deps`: those in other flow runs are edges Prefect cannot
        draw, so the iteration's record names them and where they are."""
        mine = self.block(op.iteration)
        other = [d for d in deps if self._block.get(d.iteration, d.iteration) != mine]
        if other:
            self._waited.setdefault(op.iteration, {})[op.name] = [d.name for d in other]
            where = self._where.setdefault(op.iteration, {})
            for d in other:
                where[d.iteration] = self._name(self._block.get(d.iteration, d.iteration))

    def op_done(self, record: OpRecord, *, decisions: list[Decision] | None = None, **kwargs: Any) -> None:
        if record.op.iteration not in self._recorded:
            self._ops.setdefault(record.op.iteration, []).append(record)
        if decisions is not None and len(decisions) > self._seen:  # rare: a decision since the last op
            for d in decisions[self._seen:]:
                it = iteration_record.decision_iteration(d)
                it = record.op.iteration if it is None else it
                if it not in self._recorded:
                    self._decided.setdefault(it, []).append(d)
            self._seen = len(decisions)
        if self._rows:
            self._finish_rows()

    def iteration_done(self, row: dict[str, Any], **kwargs: Any) -> None:
        """The iteration tracker, a hook called before this one, emits a row as its last op
        ends: the row waits for that op to reach this hook too (`op_done`, or `close`)."""
        self._rows[int(row["iteration"])] = row

    def _finish_rows(self) -> None:
        for it, row in sorted(self._rows.items()):
            self.finished(it, row)
        self._rows.clear()

    def finished(self, iteration: int, row: dict[str, Any] | None = None) -> None:
        """`iteration` is final: its record (`row`: its metrics row) joins its flow run's, which
        ends Completed (its task run in the parent too) once every iteration of it is final. An
        iteration whose ops all ran in an earlier attempt, which stopped before its row was final
        (a resume), is in a flow run of this attempt too, holding no op of it: the earlier
        attempt's was ended with it, and every iteration ends in a Completed one."""
        ran = iteration in self._block  # an op of it came in this attempt: it counts for the pace
        block = self.block(iteration)
        self._ask(block)
        self._recorded.add(iteration)
        if ran:
            self._ends += 1
            self._t_end = self._clock()
        record = None if row is None else iteration_record.IterationRecord(
            iteration, row, self._ops.pop(iteration, []), self._decided.pop(iteration, []),
            self._waited.pop(iteration, {}), self._where.pop(iteration, {}))
        self._final.setdefault(block, {})[iteration] = record
        self._end_if_final(block)

    def forget(self, below: int) -> None:
        """Drop the flow runs of iterations before `below` that are Completed (every op of
        them is reported); the others stay until `close`."""
        for b in [b for b in list(self._ended) if self._last.get(b, b) < below and b != self._newest]:  # list(): one step under the GIL
            self._ended.discard(b)
            self._passed.discard(b)
            self.runs.pop(b, None)
            self._asked.discard(b)
            for it in self._members.pop(b, ()):
                self._block.pop(it, None)
            self._last.pop(b, None)
        self._recorded -= {i for i in self._recorded if i < below}

    def close(self, error: BaseException | None, timeout_s: float = 60.0) -> bool:
        """The training flow stops: the flow runs still open get the records of their final
        iterations and end in the state that matches its own, with `error` as the reason. Waits
        for the API calls still queued: while the API answers, for at most `timeout_s`; while it
        does not, within the run's budget for a silent API (`ApiWatch.deadline`), past which the
        API is given up on. True: every call was made."""
        self._finish_rows()
        for block, final in sorted(self._final.items()):
            self._put(("end", block, (final, False)))
        self._final.clear()
        self._put(("close", -1, error))
        since = time.monotonic()
        while True:
            self._thread.join(1.0)
            if not self._thread.is_alive():
                return True
            now, silent = time.monotonic(), self.api.failing_since is not None
            if silent and now >= self.api.deadline():
                self.api.give_up()
                break
            if not silent and now >= since + timeout_s:
                log.warning("the Prefect API did not take the iterations' flow-run states within %.0f s; "
                            "the run's own records are complete (metrics/ops.jsonl)", timeout_s)
                break
        self._closing.set()
        return False

    # -- the API thread ------------------------------------------------------------------------
    def _next(self, until: float | None) -> tuple[str, int, Any] | None:
        """The next call to make (creations first), or None once `until` (monotonic) passes."""
        with self._wake:
            while not self._opens and not self._rest:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._wake.wait(left)
            return (self._opens or self._rest).popleft()

    def _work(self) -> None:
        ends: list[tuple[int, Any]] = []  # waiting for the ends queued within `end_lag_s`
        until: float | None = None
        with temporary_settings(updates=self._settings):
            while True:
                item = self._next(until)
                # the lag is over (or the run ends): never later, however busy the queue
                if item is None or item[0] == "close" or (until is not None and time.monotonic() >= until):
                    self._end_all(ends)
                    ends, until = [], None
                if item is None:
                    continue
                what, block, arg = item
                if what == "open":
                    self._call(lambda b=block: self._open(b))
                elif what == "end":
                    ends.append((block, arg))
                    until = until if until is not None else time.monotonic() + self.end_lag_s
                else:
                    type_ = leftovers.ending(arg)
                    message = leftovers.reason(type_, arg)
                    for b in sorted(set(self.runs) - self._ended):
                        self._call(lambda b=b, t=type_, m=message: self._set(b, t, m))
                    return

    def _end_all(self, ends: list[tuple[int, Any]]) -> None:
        """Record the flow runs in `ends` and complete those whose iterations are all final:
        their log lines in one call, then each one's artifact and Completed state."""
        todo = [(b, complete, self._record(b, final)) for b, (final, complete) in ends
                if b in self.runs and b not in self._ended]
        if not todo:
            return
        logs = [(self.runs[b][1], line) for b, _, (lines, _) in todo for line in lines]
        if logs and PREFECT_LOGGING_TO_API_ENABLED.value():
            self._call(lambda: self._logs(logs))
        for b, complete, shown in todo:
            self._call(lambda b=b, c=complete, shown=shown: self._end(b, *shown, complete=c))
            if complete:
                self._ended.add(b)  # after the call: `forget` may drop it now

    def _call(self, fn: Callable[[], None]) -> None:
        warned = False
        while not self._closing.is_set():
            try:
                fn()
                self.api.answered()
                return
            except Exception as exc:  # the API away: try again while the run goes on
                self.api.failed()
                if not warned:
                    log.warning("Prefect API call for the iterations' flow runs failed (%s); trying again", exc)
                    warned = True
                self._closing.wait(RETRY_S)

    def _open(self, block: int) -> None:
        name = self._name(block)
        tags = [self.run_name] if self.run_name else []
        inputs = {"previous": [TaskRunResult(id=self._last_tracking)]} if self._last_tracking else {}
        tracking = self.client.create_task_run(_TRACKING, self.parent, dynamic_key=name, name=name,
                                               extra_tags=tags, state=Running(), task_inputs=inputs)
        if self._flow_id is None:
            self._flow_id = self.client.create_flow(ITERATION_FLOW)
        last = self._last.get(block, block)
        # As `create_flow_run` makes it, less its upsert of the flow (a call per flow run).
        child = FlowRunCreate(
            flow_id=self._flow_id, flow_version=ITERATION_FLOW.version, name=name,
            parameters={"iteration": block, **({"last": last} if last != block else {})},
            context={}, tags=tags, parent_task_run_id=tracking.id, state=to_state_create(Running()),
            empirical_policy=FlowRunPolicy(retries=ITERATION_FLOW.retries,
                                           retry_delay=int(ITERATION_FLOW.retry_delay_seconds or 0)))
        got = self.client.request("POST", "/flow_runs/", json=child.model_dump(mode="json", exclude_unset=True))
        self.calls["open"] += 1
        self._last_tracking = tracking.id
        self.runs[block] = (tracking.id, uuid.UUID(got.json()["id"]))

    def _set(self, block: int, type_: str, message: str) -> None:
        """The flow run in `type_`; the server gives its tracking task run the same state
        (`UpdateSubflowParentTask`), so that takes no call of its own."""
        self.client.set_flow_run_state(self.runs[block][1], leftovers.state(type_, message), force=True)
        self.calls["state"] += 1

    def _logs(self, lines: list[tuple[uuid.UUID, str]]) -> None:
        now = dt.datetime.now(dt.UTC)
        self.client.create_logs([LogCreate(name="flexmarl-iteration", level=logging.INFO, message=line,
                                           timestamp=now, flow_run_id=child) for child, line in lines])
        self.calls["logs"] += 1

    def _record(self, block: int, final: dict[int, iteration_record.IterationRecord | None]
                ) -> tuple[list[str], str | None]:
        """The flow run's log lines and artifact, its iterations in order (none for a row that
        cannot be shown: the flow run still ends)."""
        lines: list[str] = []
        parts: list[str] = []
        for it, rec in sorted(final.items()):
            if rec is None:
                continue
            try:
                lines += iteration_record.log_lines(rec, self.run_name, self.iterations)
                parts.append(iteration_record.markdown(rec, self.run_name, self.iterations))
            except Exception as exc:  # a row without the usual figures: no record, never a stuck thread
                log.warning("no record for iteration %d's flow run: %s: %s", it, type(exc).__name__, exc)
        return lines, ("\n".join(parts) if parts else None)

    def _end(self, block: int, lines: list[str], markdown: str | None, *, complete: bool = True) -> None:
        """The flow run's artifact, then Completed where all its iterations are final (its log
        lines went before, `_end_all`): a reader who sees it Completed finds its record there."""
        child = self.runs[block][1]
        waits = [x for x in lines if x.startswith("waited on")]  # the edges Prefect cannot draw
        if markdown is not None:
            self.client.create_artifact(ArtifactCreate(
                type="markdown", data=markdown, flow_run_id=child,
                description="; ".join([f"{self._name(block)}: ops, times, rewards, decisions", *waits])))
            self.calls["artifact"] += 1
        if complete:
            final = [x for x in lines if x.startswith("iteration ")][-1:]
            self._set(block, "COMPLETED", "; ".join(final + waits) or "iterations final")
