"""Holding ops on the real stack until the test has seen what it needs (`hold@` markers, see
`flexmarl_core.stages.faults`): a thread watches which ops are held and releases them, so no
test bets that a sleep outlasts other work."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from flexmarl_core.stages.faults import faults_dir, held_ops, release


class Holds:
    """`hold@<op>` markers for `ops` beside `run_dir`; while the block runs, a thread releases
    every one of them as soon as `ready(held)` is true of the ops held at that moment (then
    `seen` holds them), or when `limit_s` passes first (`seen` stays None and the test fails
    on it, without hanging). Leaving the block releases whatever is left.

        with Holds(run_dir, [a, b], lambda held: held == {a, b}) as holds:
            run_the_flow()
        assert holds.seen == {a, b}
    """

    POLL_S = 0.05

    def __init__(self, run_dir: str | os.PathLike[str], ops: Iterable[str],
                 ready: Callable[[set[str]], bool], *, limit_s: float = 300.0) -> None:
        self.run_dir = str(run_dir)
        self.ops = list(ops)
        self.ready = ready
        self.limit_s = limit_s
        #: the ops held at once when `ready` said yes
        self.seen: set[str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hold-watcher", daemon=True)

    def __enter__(self) -> Holds:
        folder = Path(faults_dir(self.run_dir))
        folder.mkdir(parents=True, exist_ok=True)
        for op in self.ops:
            (folder / f"hold@{op}").write_text(str(self.limit_s + 60))  # the watcher decides first
        self._thread.start()
        return self

    def _watch(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            held = held_ops(self.run_dir) & set(self.ops)
            if held and self.ready(held):
                self.seen = held
                break
            time.sleep(self.POLL_S)
        self.release_all()

    def release_all(self) -> None:
        for op in self.ops:
            release(self.run_dir, op)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def fired(self) -> bool:
        """Every held op went on (its markers are gone)."""
        folder = Path(faults_dir(self.run_dir))
        return not any((folder / f"{kind}@{op}").exists() for op in self.ops for kind in ("hold", "held"))
