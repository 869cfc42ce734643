"""Workload callables under a deadline. A reward that hangs on one input fails that input's
trajectories, which then train nobody (as a program trajectory that raises), and the run goes
on; several inputs in a row past the deadline mean the reward itself is broken, and the run
stops with one error naming the callable and the input.

A Python call cannot be stopped from outside, so a timed-out call is left running on a daemon
thread of its own (it ends with its process: the worker), and the next call gets a new thread.

The count in a row is the run's, not one process's (`RunStreak`): every worker scores inputs at
once, and a reward that always hangs would otherwise time out `reward_timeouts` inputs per
worker before one of them stopped the run. Its files live at the run's location and are
written only around a timeout (which takes the deadline's seconds), so a run whose rewards
answer in time never touches them.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class RewardHungError(RuntimeError):
    """Several inputs in a row ran past the reward's deadline: another try would hang alike."""

    retryable = False


class _Runner:
    """One daemon thread that runs batches of calls in turn; abandoned (and replaced) when a
    call hangs."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="flexmarl-workload-call", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get().run()


class _Batch:
    """Calls the runner makes one after another; `at` says which one runs and since when, so
    the caller can tell a call that hangs from a batch that is merely long."""

    def __init__(self, fns: Sequence[Callable[[], Any]]) -> None:
        self.fns = fns
        self.values: list[Any] = []
        self.error: BaseException | None = None
        self.at: tuple[int, float] = (0, time.monotonic())  # (call running, its start)
        self.done = threading.Event()
        #: set by the caller once a call ran late: a call that returns after all makes no more
        self.abandoned = False

    def run(self) -> None:
        try:
            for i, fn in enumerate(self.fns):
                if self.abandoned:
                    break
                self.at = (i, time.monotonic())
                self.values.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = exc
        finally:
            self.done.set()

    def wait(self, seconds: float) -> int | None:
        """None once every call returned (or one raised); else the index of a call that has
        run `seconds` without returning."""
        while not self.done.wait(max(self.at[1] + seconds - time.monotonic(), 0.0)):
            i, since = self.at
            if time.monotonic() - since >= seconds and not self.done.is_set():
                self.abandoned = True
                return i
        return None


class Files(Protocol):
    """What `RunStreak` uses of a run's location (`runfiles.location.RunLocation`)."""

    def list(self, key: str = "") -> list[str]: ...
    def read_text(self, key: str) -> str: ...
    def write_text(self, key: str, text: str) -> None: ...


class RunStreak:
    """The run's inputs in a row past the reward's deadline, across its worker processes, kept
    under `folder` at the run's location: one file per timeout (`t-<time>-<process>-<n>`,
    naming its input) and one per process that has scored an input in time since one
    (`ok-<process>`, holding when). The count is the timeouts after the newest `ok` time.

    A process writes its `ok` only when it knows of a timeout not yet followed by one: one it
    saw (its own, or listed with it), or one a look at the folder finds, at most every
    `look_every_s` while it scores inputs. So a run whose rewards answer in time lists the
    folder once in a while and writes nothing."""

    def __init__(self, files: Files, folder: str = "deadlines/reward", look_every_s: float = 10.0) -> None:
        self.files, self.folder, self.look_every_s = files, folder, look_every_s
        self.me = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        self._n = 0
        self._dirty = False  # a timeout this process knows of is not yet followed by its `ok`
        self._looked = float("-inf")

    def _count(self) -> int:
        names = self.files.list(self.folder)
        oks = [float(self.files.read_text(f"{self.folder}/{n}")) for n in names if n.startswith("ok-")]
        since = max(oks, default=float("-inf"))
        return sum(1 for n in names if n.startswith("t-") and float(n.split("-")[1]) > since)

    def timed_out(self, input_id: str) -> int:
        """Record a timeout of `input_id`; the run's count in a row, this one included."""
        self._n += 1
        self.files.write_text(f"{self.folder}/t-{time.time():.6f}-{self.me}-{self._n}", input_id)
        self._dirty = True
        return self._count()

    def in_time(self) -> None:
        """An input scored in time: the run's count starts again, if any timeout is counted."""
        now = time.monotonic()
        if not self._dirty and now - self._looked >= self.look_every_s:
            self._looked = now
            self._dirty = self._count() > 0
        if self._dirty:
            self.files.write_text(f"{self.folder}/ok-{self.me}", f"{time.time():.6f}")
            self._dirty = False


class Deadline:
    """Calls of one workload callable (`what`), each bounded by `seconds`; after `limit`
    inputs in a row past it, `RewardHungError`. One per run per process; `streak`: the
    run's count across its processes (`RunStreak`), else this process's."""

    def __init__(self, what: str, seconds: float, limit: int, streak: RunStreak | None = None) -> None:
        self.what, self.seconds, self.limit = what, seconds, limit
        self.streak = streak
        self.in_a_row = 0  # the run's count at the last timeout (this process's, without a streak)
        self._runner: _Runner | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], input_id: str) -> tuple[bool, T | None]:
        """(True, fn()) if it returned in time (its error re-raised here), else (False, None)."""
        return self.call_many([(fn, input_id)])[0]

    def call_many(self, calls: Sequence[tuple[Callable[[], T], str]]) -> list[tuple[bool, T | None]]:
        """`call` of each `(fn, input_id)` in turn, each bounded by `seconds` from its own start,
        handed to the runner thread together: one handoff for the lot, not one per call (a
        thread handoff costs ~0.1 ms, as much as a cheap reward). Once an input's call runs
        past the deadline, that input's later calls are not made: (False, None) for each. The
        first error a call raises is re-raised here."""
        out: list[tuple[bool, T | None]] = [(False, None)] * len(calls)
        hung: set[str] = set()
        todo = list(range(len(calls)))
        with self._lock:  # one batch at a time: a thread of this process's ops may share it
            while todo := [j for j in todo if calls[j][1] not in hung]:
                if self._runner is None:
                    self._runner = _Runner()
                batch = _Batch([calls[j][0] for j in todo])
                self._runner.jobs.put(batch)
                late = batch.wait(self.seconds)
                values = batch.values if late is None else batch.values[:late]
                for j, value in zip(todo, values, strict=False):
                    out[j] = (True, value)
                if values or (late is None and batch.error is not None):
                    # a call returned in time (or raised in time): the run's count starts again
                    self.in_a_row = 0
                    if self.streak is not None:
                        self.streak.in_time()
                if late is None:
                    if batch.error is not None:
                        raise batch.error
                    break
                self._runner = None  # left to its hung call; the rest get a fresh thread
                input_id = calls[todo[late]][1]
                hung.add(input_id)
                self.in_a_row = self.streak.timed_out(input_id) if self.streak else self.in_a_row + 1
                if self.in_a_row >= self.limit:
                    raise RewardHungError(
                        f"{self.what}: {self.in_a_row} inputs in a row ran past its deadline of "
                        f"{self.seconds:g} s (the last: input_id {input_id!r}); it hangs or is too slow: "
                        "fix it, or raise cluster.deadlines.per_kind_s.reward")
                todo = todo[late + 1:]
        return out
