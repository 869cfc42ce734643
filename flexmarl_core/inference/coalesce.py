"""Rollouts of LoRA agents on one base that run at the same time in a worker share one decode.

A worker that runs several rollout ops at once (`nthreads` > 1 and room in its rollout tags,
e.g. the planner's micro-batch 1 beside the solver's micro-batch 0) would decode them one after
another on its one shared-base engine. With `codesign.mixed_batch_window_s` set, each such op
hands its request to its base's `Coalescer` instead, as a serving engine batches requests:

- the first request to find the engine free leads: it waits up to `window_s` for peers, then
  takes every request queued (one weights version per agent: a request for another version of
  an agent already in the batch waits for the next decode);
- it brings each request's agent to its version (`load`), runs ONE `generate_requests` decode
  (each row through its own agent's adapter, each request sampled with its own seed), and hands
  each op its own rows;
- requests that arrive while a decode runs queue, and the next leader takes them all.

The ops stay separate Dask tasks (routing, retries, the op log and exactly-once writes do not
change); only their decode is shared. A request's tokens are the ones it would sample alone;
its logprobs may differ by a few ulps, since a bigger batch changes the summation order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation

#: `load(agent, version)`: the shared engine with `agent`'s adapter at `version`, and whether
#: that version came from a sync's push
Loader = Callable[[str, int], tuple[Any, bool]]


@dataclass
class _Request:
    agent: str
    version: int
    prompts: Sequence[str]
    sampling: SamplingConfig
    seed: int
    gens: list[Generation] | None = None
    error: BaseException | None = None
    stats: dict[str, float] = field(default_factory=dict)


class Coalescer:
    """One shared-base engine's queue of generate requests (see the module docstring)."""

    def __init__(self, window_s: float, load: Loader, lock: threading.RLock) -> None:
        self.window_s = window_s
        self._load = load
        self._lock = lock  # the worker context's: engines and trainers change under it
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._leading = False

    def generate(self, agent: str, version: int, prompts: Sequence[str], sampling: SamplingConfig,
                 seed: int) -> tuple[list[Generation], dict[str, float]]:
        """`agent`'s generations of `prompts` at weights `version`, and what the decode they
        ran in held: `ops` (requests), `agents` (distinct agents), `rows`, `pushed` (1 when
        this agent's weights came from a sync's push) and, on an engine with a `DecodeClock`,
        this request's share (by rows) of the decode's `prefill_s` and `generate_s`."""
        req = _Request(agent, int(version), list(prompts), sampling, int(seed))
        with self._cv:
            self._queue.append(req)
            self._cv.notify_all()
            while req.gens is None and req.error is None:
                if self._leading:
                    self._cv.wait()
                    continue
                self._leading = True
                deadline = time.monotonic() + self.window_s
                while (left := deadline - time.monotonic()) > 0:
                    self._cv.wait(left)
                batch = self._take()
                self._cv.release()
                try:
                    self._decode(batch)
                finally:
                    self._cv.acquire()
                    self._leading = False
                    self._cv.notify_all()
        if req.error is not None:
            raise req.error
        assert req.gens is not None
        return req.gens, req.stats

    def _take(self) -> list[_Request]:
        """The queued requests one decode can serve, oldest first; the rest stay queued."""
        versions: dict[str, int] = {}
        batch, rest = [], []
        for r in self._queue:
            if versions.setdefault(r.agent, r.version) == r.version:
                batch.append(r)
            else:
                rest.append(r)
        self._queue = rest
        return batch

    def _decode(self, batch: list[_Request]) -> None:
        with self._lock:
            ready, engine = [], None
            for r in batch:
                try:
                    engine, pushed = self._load(r.agent, r.version)
                except BaseException as e:  # this request fails alone; the others decode
                    r.error = e
                    continue
                r.stats["pushed"] = float(pushed)
                ready.append(r)
            if not ready:
                return
            clock = getattr(engine, "clock", None)  # the HF engine's (`DecodeClock`)
            before = clock.copy() if clock is not None else None
            try:
                outs = engine.generate_requests([(r.agent, r.prompts, r.sampling, r.seed) for r in ready])
                spent = clock.since(before) if clock is not None and before is not None else {}
            except BaseException as e:
                for r in ready:
                    r.error = e
                return
        shared = {"ops": float(len(ready)), "agents": float(len({r.agent for r in ready})),
                  "rows": float(sum(len(r.prompts) for r in ready))}
        for r, gens in zip(ready, outs, strict=True):
            r.stats.update(shared)
            # each request's share of the decode's seconds, by its rows: they add up to the decode's
            r.stats.update({k: v * len(r.prompts) / shared["rows"] for k, v in spent.items()})
            r.gens = gens
