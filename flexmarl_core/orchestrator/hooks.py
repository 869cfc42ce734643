"""A run's hooks: objects called as ops end and iterations finish. Override only what you need.

Every hook has a no-op default and takes `**kwargs`, so an argument added later does not break
an existing hook (dask's plugin style). Hooks run in the thread that runs the orchestrator's
loop, in the order they were given, while the loop waits: keep them short.

    class Printer(RunHook):
        def op_done(self, record, **kwargs):
            print(record.op.name, record.result.seconds)

    run.train(cfg, run_dir, executor, hooks=[Printer()])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flexmarl_core.ops import OpRecord

if TYPE_CHECKING:
    from flexmarl_core.control import Decision
    from flexmarl_core.driver.metrics import IterationTracker, MetricsWriter


class RunHook:
    """Base class of a run's hooks (see the module docstring)."""

    def op_done(self, record: OpRecord, *, in_flight_since: float | None = None,
                decisions: list[Decision] | None = None, **kwargs: Any) -> None:
        """An op finished and was recorded (a fused run: each of its ops, in chain order).
        Called by the orchestrator. `in_flight_since`: when the earliest op still running was
        submitted (None: none is); `decisions`: the control plane's decisions so far (its own
        list, which grows as the run goes)."""

    def iteration_done(self, row: dict[str, Any], **kwargs: Any) -> None:
        """An iteration's metrics row is final and written (`run.train`; rows come in
        iteration order, each once)."""


class Callbacks(RunHook):
    """Plain functions as a hook: `op_done(record)`, `iteration_done(row)`, either optional."""

    def __init__(self, op_done: Callable[[OpRecord], None] | None = None,
                 iteration_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._op, self._iteration = op_done, iteration_done

    def op_done(self, record: OpRecord, **kwargs: Any) -> None:
        if self._op is not None:
            self._op(record)

    def iteration_done(self, row: dict[str, Any], **kwargs: Any) -> None:
        if self._iteration is not None:
            self._iteration(row)


class WriteOpLog(RunHook):
    """Each finished op goes to the run's op log (`metrics.MetricsWriter.op`)."""

    def __init__(self, writer: MetricsWriter) -> None:
        self.writer = writer

    def op_done(self, record: OpRecord, **kwargs: Any) -> None:
        self.writer.op(record)


class TrackIterations(RunHook):
    """Each finished op goes to the iteration tracker, which emits an iteration's row once the
    iteration is final (`metrics.IterationTracker`)."""

    def __init__(self, tracker: IterationTracker) -> None:
        self.tracker = tracker

    def op_done(self, record: OpRecord, *, in_flight_since: float | None = None,
                decisions: list[Decision] | None = None, **kwargs: Any) -> None:
        self.tracker.add(record, in_flight_since, decisions if decisions is not None else [])
