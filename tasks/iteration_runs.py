"""Each training iteration as a flow run nested under the training run's.

The Prefect server draws a flow run's graph only up to 10,000 task runs, and a run of the
default team has ~35 ops per iteration, so one flat flow run stops drawing at iteration ~290.
Here the training run's flow run holds one task run per iteration ("iteration 3", each with the
previous one as its upstream input), and that task run is the parent of the iteration's own
flow run (`flexmarl-iteration`, named "iteration 3"), which holds the iteration's op task runs
(`tasks/task_runs.py`): every graph stays the size of one iteration's MEG, and the parent lists
the iterations, as a subflow call would draw them.

An iteration's flow run is asked for when its first op is submitted and set Completed when the
iteration is final (its metrics row emitted); one still open when the training flow stops is
set Failed (or Crashed if the flow is crashing) with the flow's error. A flow-run retry (a
resume) opens new ones for the iterations it still runs or first reports, named "iteration 3
(flow run 2)".

The API calls (five per iteration) run on a thread of their own, in order: the orchestrator
never waits for the API, and an API server that is away delays only the reports (the op task
runs of an iteration whose flow run does not exist yet wait in the reporter, `flow_run_id`
answering None until it does), as the events of the op task runs themselves are buffered.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from prefect import Flow, Task
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import TaskRunResult
from prefect.states import Completed, Crashed, Failed, Running

from flexmarl_core.orchestrator.hooks import RunHook

__all__ = ["ITERATION_FLOW", "IterationFlowRuns"]

log = logging.getLogger(__name__)


def _iteration(iteration: int) -> None:
    """One training iteration's ops (made by the training flow, never called)."""


#: the flow the iterations' flow runs belong to (registered by name on first use)
ITERATION_FLOW: Flow[Any, Any] = Flow(_iteration, name="flexmarl-iteration")
_TRACKING = Task(_iteration, name="flexmarl-iteration")
#: seconds between two tries of an API call that failed (the client's own retries spent)
RETRY_S = 2.0


class IterationFlowRuns(RunHook):
    """The flow runs of a training flow run's iterations (see the module docstring); as a run
    hook, it completes each iteration's flow run once its metrics row is final."""

    def __init__(self, client: SyncPrefectClient, parent_flow_run_id: uuid.UUID | str,
                 flow_run_count: int = 1) -> None:
        self.client = client
        self.parent = uuid.UUID(str(parent_flow_run_id))
        self.flow_run_count = flow_run_count
        #: iteration -> (its task run in the parent, its own flow run), once made
        self.runs: dict[int, tuple[uuid.UUID, uuid.UUID]] = {}
        self._asked: set[int] = set()
        #: iterations whose runs the API thread set Completed (it adds, `forget` removes)
        self._ended: set[int] = set()
        self._todo: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self._last_tracking: uuid.UUID | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="flexmarl-iteration-runs", daemon=True)
        self._thread.start()

    def _name(self, iteration: int) -> str:
        return f"iteration {iteration}" + ("" if self.flow_run_count <= 1 else f" (flow run {self.flow_run_count})")

    # -- the flow's thread ---------------------------------------------------------------------
    def flow_run_id(self, iteration: int) -> uuid.UUID | None:
        """The flow run that holds `iteration`'s ops, or None while it is being made (asked
        for on the first call)."""
        got = self.runs.get(iteration)
        if got is not None:
            return got[1]
        self._ask(iteration)
        return None

    def _ask(self, iteration: int) -> None:
        if iteration not in self._asked:
            self._asked.add(iteration)
            self._todo.put(("open", iteration, None))

    def iteration_done(self, row: dict[str, Any], **kwargs: Any) -> None:
        self.finished(int(row["iteration"]))

    def finished(self, iteration: int) -> None:
        """`iteration` is final: its flow run and its task run in the parent become Completed.
        One whose ops all ran in an earlier attempt, which stopped before its row was final (a
        resume), gets a flow run of this attempt too, holding no op: the earlier attempt's
        was set Failed with it, and every iteration ends with a Completed one."""
        self._ask(iteration)
        self._todo.put(("end", iteration, None))

    def forget(self, below: int) -> None:
        """Drop the iterations before `below` whose runs are Completed (every op of them is
        reported); the others stay until `close`."""
        for it in [i for i in list(self._ended) if i < below]:  # list(): one step under the GIL
            self._ended.discard(it)
            self.runs.pop(it, None)
            self._asked.discard(it)

    def close(self, error: BaseException | None, timeout_s: float = 60.0) -> None:
        """The training flow stops: iterations still open failed with it (`error`), or, when it
        ended well, are Completed. Waits up to `timeout_s` for the API calls still queued."""
        self._todo.put(("close", -1, error))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._closing.set()
            log.warning("the Prefect API did not take the iterations' flow-run states within %.0f s; "
                        "the run's own records are complete (metrics/ops.jsonl)", timeout_s)

    # -- the API thread ------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            what, iteration, error = self._todo.get()
            if what == "open":
                self._call(functools.partial(self._open, iteration))
            elif what == "end":
                if iteration in self.runs and iteration not in self._ended:
                    self._call(functools.partial(self._set, iteration, Completed))
                    self._ended.add(iteration)  # after the call: `forget` may drop it now
            else:
                for it in sorted(set(self.runs) - self._ended):
                    self._call(functools.partial(self._stop, it, error))
                return

    def _call(self, fn: Callable[[], None]) -> None:
        while not self._closing.is_set():
            try:
                fn()
                return
            except Exception as exc:  # the API away: try again (the client's retries are spent)
                log.warning("Prefect API call for the iterations' flow runs failed (%s); trying again", exc)
                time.sleep(RETRY_S)

    def _open(self, iteration: int) -> None:
        name = self._name(iteration)
        inputs = {"previous": [TaskRunResult(id=self._last_tracking)]} if self._last_tracking else {}
        tracking = self.client.create_task_run(_TRACKING, self.parent, dynamic_key=name, name=name,
                                               state=Running(), task_inputs=inputs)
        child = self.client.create_flow_run(ITERATION_FLOW, name=name, parameters={"iteration": iteration},
                                            parent_task_run_id=tracking.id, state=Running())
        self._last_tracking = tracking.id
        self.runs[iteration] = (tracking.id, child.id)

    def _set(self, iteration: int, state: Any, message: str | None = None) -> None:
        tracking, child = self.runs[iteration]
        self.client.set_flow_run_state(child, state(message=message), force=True)
        self.client.set_task_run_state(tracking, state(message=message), force=True)

    def _stop(self, iteration: int, error: BaseException | None) -> None:
        if error is None:
            self._set(iteration, Completed)
            return
        crashed = isinstance(error, KeyboardInterrupt | SystemExit)
        self._set(iteration, Crashed if crashed else Failed,
                  f"the training flow stopped: {type(error).__name__}: {str(error)[:400]}")
