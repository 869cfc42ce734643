"""Compaction in the run: each iteration's store partitions folded into one fragment each once
the iteration is final (`store.compact`).

An iteration is final when every op of it has ended (`IterationTracker`): its samples are
written, rewarded and consumed by their step, so nothing writes its partitions any more but a
resumed op that finished unrecorded, whose rewrite the store deduplicates by sample id and
policy version (and keeps in a fragment of its own if it lands during the fold).
`MEGStore.compact` is safe beside readers: they see the old fragments and the new one together
and deduplicate, never losing or double-counting a sample. It runs on a thread of the flow
process, one partition at a time, so the run's ops never wait for it; `close` waits for the
rest. A store that gains ~12 files per agent and iteration then holds one per partition.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from flexmarl_core.orchestrator.hooks import RunHook
from storage import MEGStore

__all__ = ["Compaction"]

log = logging.getLogger(__name__)


class Compaction(RunHook):
    """Compacts each final iteration's partitions (every agent's samples and status) in a thread."""

    def __init__(self, store: MEGStore) -> None:
        self.store = store
        #: (iterations, walk_back): see `catch_up`; None stops the thread
        self._todo: queue.Queue[tuple[list[int], bool] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        #: partitions compacted, and seconds spent, by this run
        self.partitions = 0
        self.seconds = 0.0
        self._abandon = threading.Event()

    def iteration_done(self, row: dict[str, Any], **kwargs: Any) -> None:
        self._put([int(row["iteration"])], walk_back=False)

    def catch_up(self, iterations: Iterable[int]) -> None:
        """Compact what an earlier attempt finished but a kill left: its last iterations not
        compacted yet, the newest perhaps half compacted (the new fragment committed, the old
        ones not yet deleted). Compaction runs in order, so they are a tail: walked newest
        first, it stops at the first iteration already compact (one listing per partition)."""
        self._put(sorted(iterations, reverse=True), walk_back=True)

    def _put(self, iterations: list[int], *, walk_back: bool) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="flexmarl-compaction", daemon=True)
            self._thread.start()
        self._todo.put((iterations, walk_back))

    def _work(self) -> None:
        while (item := self._todo.get()) is not None and not self._abandon.is_set():
            iterations, walk_back = item
            for it in iterations:
                if self._compact(it) and walk_back:
                    break  # the catch-up reached what the earlier attempt compacted

    def _compact(self, it: int) -> bool:
        """Compact one iteration's partitions; whether every one of them was compact already
        (none needed it and none failed)."""
        t0, done, failed = time.perf_counter(), 0, False
        try:
            for agent in self.store.agents():
                done += self.store.compact(agent, it) is not None
        except Exception as exc:  # the run's samples stay readable in their fragments
            log.warning("store compaction of iteration %d failed (its fragments stay as they are, "
                        "readable): %s", it, exc)
            failed = True
        self.partitions += done
        self.seconds += time.perf_counter() - t0
        return done == 0 and not failed

    def close(self, *, abandon: bool = False) -> None:
        """Wait until every queued iteration is compacted (`abandon`: the run failed; only the
        one being compacted now is finished)."""
        if self._thread is not None:
            if abandon:
                self._abandon.set()
            self._todo.put(None)
            self._thread.join()
            self._thread = None
