"""Contracts of program teams: what a decode takes, what a call records, who decodes.

A program team's calls reach flexmarl's engines through its OpenAI-compatible endpoint
(`gateway.py`); the endpoint batches them per agent and hands each batch to a `Dispatcher`,
which decodes it on an instance of the agent: in this process (`engines.LocalDispatcher`),
on a Dask worker that holds one (`cluster.DaskDispatcher`), or from the workload's
demonstrations (`engines.DemoDispatcher`, the SFT warm start). Every answered call becomes a
`CallRecord` of its trajectory; `capture.py` turns them into MEG Store rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation

if TYPE_CHECKING:
    from flexmarl_core.runtime.view import WorkerView


class ProgramError(RuntimeError):
    """A program team that cannot run: a program that does not load, or every trajectory of an
    op failed. The message names the program, the trajectory and the error."""


class PolicyFailure(Exception):
    """Raise it (or a subclass) from a program when the trajectory failed because of what the
    model said: its calls so far are trained with `team.failure_reward`, not dropped
    (`team.policy_errors` names other exception types that mean the same)."""


class MalformedToolCall(PolicyFailure):
    """The trajectory ended on a tool call the model broke: one that does not parse in the agent's
    tool format, or calls a function it was not offered. flexmarl sets it itself (the program
    saw the answer as text and returned); a program may raise it too."""


#: exception types that are the policy's failure whatever the config adds: the frameworks'
#: verdicts on a model's output (an answer cut at its limit, a turn limit, a malformed tool call
#: or JSON, an output that fails its schema), matched by `module.QualName` along the MRO
POLICY_ERRORS: tuple[str, ...] = (
    "flexmarl_core.programs.api.PolicyFailure",
    "agents.exceptions.ModelBehaviorError",
    "agents.exceptions.MaxTurnsExceeded",
    "langgraph.errors.GraphRecursionError",
    "langchain_core.exceptions.OutputParserException",
    "pydantic_core._pydantic_core.ValidationError",
    "json.decoder.JSONDecodeError",
)


def policy_error_type(exc: BaseException, extra: tuple[str, ...] = ()) -> str | None:
    """The name of the first class in `exc`'s MRO that `POLICY_ERRORS` or `extra` names (by
    `module.QualName`, or by bare name in `extra`), else None: the program's own failure."""
    names = set(POLICY_ERRORS) | set(extra)
    for cls in type(exc).__mro__:
        full = f"{cls.__module__}.{cls.__qualname__}"
        if full in names or cls.__qualname__ in extra:
            return cls.__qualname__
    return None


class MachineryError(RuntimeError):
    """flexmarl's own machinery failed under a program (a decode that could not run): the op
    fails and is retried, it never counts as the program's wrong answer."""


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """One request's rows of a decode batch: `n` samples of one prompt, sampled with the
    request's own sampling and seed (the tokens it would get if it decoded alone)."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig
    seed: int
    n: int = 1
    #: the call's trajectory, (input_id, traj) (what a demonstration answers for)
    trajectory: tuple[str, int] = ("", 0)


@dataclass(slots=True)
class DecodeStats:
    """What a dispatcher measured of one decode: its seconds, where it ran (the instance's
    worker name) and when (wall clock)."""

    seconds: float = 0.0
    instance: str = ""
    t_start: float = 0.0
    t_end: float = 0.0


@runtime_checkable
class Dispatcher(Protocol):
    """Decodes one agent's batch of requests on one of its instances."""

    def capacity(self, agent: str) -> int:
        """How many decodes of `agent` may run at once (its instances)."""
        ...

    def decode(self, agent: str, version: int, groups: Sequence[DecodeGroup],
               stats: DecodeStats) -> list[list[Generation]]:
        """The generations of each group (`n` each), from weights `version` of `agent`; fills
        `stats`. Raises `MachineryError` when no instance can decode."""
        ...


@runtime_checkable
class ProgramHost(Protocol):
    """Where program ops run (injected by the cluster adapter into its workers; the default
    runs everything in this process)."""

    def detached(self) -> AbstractContextManager[None]:
        """While the op waits on its calls: let the worker run other ops meanwhile."""
        ...

    def dispatcher(self, ctx: WorkerView, worker: str) -> Dispatcher:
        """The dispatcher of a program op of the run in `ctx`, running on `worker` (this
        process's worker name)."""
        ...


@dataclass(slots=True)
class CallRecord:
    """One answered choice of one call: what the agent saw and sampled, in its trajectory."""

    agent: str
    call: int  #: index of this call (choice) among the agent's calls in the trajectory
    prompt_ids: list[int]
    prompt_text: str
    gen: Generation
    t_start: float
    t_end: float
    #: indices (in the trajectory's record list) of the calls answered before this one was made
    after: tuple[int, ...] = ()
    #: what the call is, not when it arrived: its prompt and its occurrence among identical
    #: prompts of the agent in the trajectory (the agent's calls are numbered in this order)
    identity: tuple[tuple[int, ...], int] = ((), 0)


@dataclass(slots=True)
class TrajectoryResult:
    """One trajectory's end: the program's answer or its error, and every call it made."""

    input_id: str
    traj: int
    mb: int
    answer: str | None
    error: str | None
    records: list[CallRecord] = field(default_factory=list)
    #: the type of a policy failure (`policy_error_type`): the error is the model's doing, and
    #: the trajectory's calls are trained with the failure reward; None: dropped, if it failed
    policy_error: str | None = None
    #: client-side seconds of each call, and the seconds it waited for and ran its decode
    latencies: list[tuple[float, float]] = field(default_factory=list)
