"""Workload callables under a deadline. A reward that hangs on one input fails that input's
trajectories, which then train nobody (as a program trajectory that raises), and the run goes
on; several inputs in a row past the deadline mean the reward itself is broken, and the run
stops with one error naming the callable and the input.

A Python call cannot be stopped from outside, so a timed-out call is left running on a daemon
thread of its own (it ends with its process: the worker), and the next call gets a new thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class RewardHungError(RuntimeError):
    """Several inputs in a row ran past the reward's deadline: another try would hang alike."""

    retryable = False


class _Runner:
    """One daemon thread that runs calls in turn; abandoned (and replaced) when a call hangs."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="flexmarl-workload-call", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self.jobs.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc
            finally:
                done.set()


class Deadline:
    """Calls of one workload callable (`what`), each bounded by `seconds`; after `limit`
    inputs in a row past it, `RewardHungError`. One per run per process."""

    def __init__(self, what: str, seconds: float, limit: int) -> None:
        self.what, self.seconds, self.limit = what, seconds, limit
        self.in_a_row = 0
        self._runner: _Runner | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], input_id: str) -> tuple[bool, T | None]:
        """(True, fn()) if it returned in time (its error re-raised here), else (False, None)."""
        with self._lock:  # one call at a time: a thread of this process's ops may share it
            if self._runner is None:
                self._runner = _Runner()
            box: dict[str, Any] = {}
            done = threading.Event()
            self._runner.jobs.put((fn, box, done))
            if not done.wait(self.seconds):
                self._runner = None  # left to its hung call; the next call gets a fresh thread
                self.in_a_row += 1
                if self.in_a_row >= self.limit:
                    raise RewardHungError(
                        f"{self.what}: {self.in_a_row} inputs in a row ran past its deadline of "
                        f"{self.seconds:g} s (the last: input_id {input_id!r}); it hangs or is too slow: "
                        "fix it, or raise cluster.deadlines.per_kind_s.reward")
                return False, None
            self.in_a_row = 0
        if "error" in box:
            raise box["error"]
        return True, box["value"]
