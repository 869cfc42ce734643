"""Dispatchers that decode in this process, and the default program host.

- `LocalDispatcher`: the agent's engine in this process (a worker's `WorkerView`, or a
  mapping of engines for an evaluation), one decode per batch.
- `DemoDispatcher`: answers every call with the workload's demonstration for that agent and
  problem, so a program can run before its agents can write anything (the SFT warm start
  records the prompts the program really sends).
- `LocalHost`: the program host when no cluster adapter installed one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flexmarl_core.inference.api import Generation
from flexmarl_core.programs.api import (
    DecodeGroup,
    DecodeStats,
    Dispatcher,
    MachineryError,
    ProgramHost,
)

if TYPE_CHECKING:
    from flexmarl_core.runtime.view import WorkerView


def generate_groups(engine: Any, groups: Sequence[DecodeGroup]) -> list[list[Generation]]:
    """One decode of `groups` on `engine` (every engine has `generate_groups`)."""
    reqs = [([list(g.prompt_ids)] * g.n, g.sampling, g.seed) for g in groups]
    return engine.generate_groups(reqs)


class LocalDispatcher:
    """Decodes on engines of this process: `engine_at(agent, version)` gives the agent's
    engine holding that version; `lock` serialises decodes with the other ops of the process."""

    def __init__(self, engine_at: Callable[[str, int], Any], lock: Any = None, instance: str = "local") -> None:
        self._engine_at = engine_at
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._instance = instance

    @classmethod
    def of_context(cls, ctx: WorkerView, instance: str) -> LocalDispatcher:
        return cls(ctx.engine, ctx.lock, instance)

    @classmethod
    def of_engines(cls, engines: Mapping[str, Any]) -> LocalDispatcher:
        return cls(lambda agent, version: engines[agent])

    def capacity(self, agent: str) -> int:
        return 1

    def decode(self, agent: str, version: int, groups: Sequence[DecodeGroup],
               stats: DecodeStats) -> list[list[Generation]]:
        try:
            with self._lock:
                t0 = time.time()
                out = generate_groups(self._engine_at(agent, version), groups)
                stats.t_start, stats.t_end = t0, time.time()
        except Exception as exc:
            raise MachineryError(f"agent {agent!r}: decode of {len(groups)} request(s) failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        stats.seconds, stats.instance = stats.t_end - stats.t_start, self._instance
        return out


class DemoDispatcher:
    """Answers each call from the workload's demonstrations (the SFT warm start of a program
    team): `demo(agent, input_id, k)` gives (target, shown) for the agent's `k`-th call in the
    trajectory: what the agent should write, and what the program is answered (the target, or
    a plausible mistake for downstream agents to see). Every call's (agent, prompt ids, target)
    is kept in `pairs`; nothing is sampled."""

    def __init__(self, demo: Callable[[str, str, int], tuple[str, str]], tokenizers: Mapping[str, Any]) -> None:
        self._demo, self._toks = demo, tokenizers
        self.pairs: list[tuple[str, list[int], str]] = []
        self._turns: dict[tuple[str, int, str], int] = {}
        self._lock = threading.Lock()

    def capacity(self, agent: str) -> int:
        return 1 << 20

    def decode(self, agent: str, version: int, groups: Sequence[DecodeGroup],
               stats: DecodeStats) -> list[list[Generation]]:
        out = []
        for g in groups:
            with self._lock:  # a trajectory's calls of one agent come one after another
                k = self._turns.get((*g.trajectory, agent), 0)
                self._turns[(*g.trajectory, agent)] = k + 1
            target, shown = self._demo(agent, g.trajectory[0], k)
            with self._lock:
                self.pairs.append((agent, list(g.prompt_ids), target))
            ids = self._toks[agent].encode(shown, add_special_tokens=False)
            gen = Generation(prompt_ids=list(g.prompt_ids), response_ids=ids, text=shown,
                             logprobs=[0.0] * len(ids), finish_reason="stop", version=version)
            out.append([gen] * g.n)
        stats.instance = "demo"
        return out


class LocalHost:
    """Everything in this process: nothing to detach from, decodes on this process's engines."""

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        yield

    def dispatcher(self, ctx: WorkerView, worker: str) -> Dispatcher:
        return LocalDispatcher.of_context(ctx, worker)


_HOST: list[ProgramHost] = []


def install_host(host: ProgramHost) -> None:
    """This process's program host (the cluster adapter installs its own in each worker)."""
    _HOST[:] = [host]


def current_host() -> ProgramHost:
    return _HOST[0] if _HOST else LocalHost()
