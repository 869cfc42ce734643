"""Loading a team program and running its trajectories against the endpoint.

A program is any function `team(problem: str, client) -> str`, named in the config as
`module:function` or `path/to/file.py:function`. `client` is a stock `openai.OpenAI`, or an
`openai.AsyncOpenAI` when the function is `async def`, pointed at flexmarl's endpoint; the
program picks an agent with `model="<agent>"` and returns the team's answer. It imports
nothing from flexmarl, so the same script runs against any OpenAI-compatible server.

One op runs its trajectories concurrently: a thread each for a plain function, one event loop
for an `async def` one. A trajectory whose program raises (or returns something other than a
string) fails alone: it is named in the result, and its calls are not trained on.

Whose call is it: every client flexmarl makes names, on each request, the trajectory whose
thread or task makes the call (a context variable), whatever client object it goes through. A
program that installs one trajectory's client as a process-global default (the OpenAI Agents
SDK's `set_default_openai_client`) is thus recorded right. A client the program builds itself
from the given `base_url` and `api_key` is its trajectory's; one shared across trajectories
(built from module-level settings) cannot be told apart, and when calls through such clients
leave a trajectory with none of its own, the op stops naming the cause and the fix.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.util
import inspect
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from flexmarl_core.programs.api import (
    CallRecord,
    MalformedToolCall,
    ProgramError,
    TrajectoryResult,
    policy_error_type,
)
from flexmarl_core.programs.gateway import VIA_HEADER, Gateway, Session, Trajectory

#: one trajectory's work: (input_id, traj, mb, problem text)
Job = tuple[str, int, int, str]

#: A client (and connection pool) per trajectory, not one shared by the op: httpcore's pool
#: rescans every connection on each request it queues or releases (quadratic in the op's
#: trajectories), which made a 256-trajectory op cost ~10 ms of CPU per call instead of ~3 ms.
_LIMITS = httpx.Limits(max_connections=8, max_keepalive_connections=8)


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client of this process (each would build its own: ~38 ms)."""
    return ssl.create_default_context()


#: the key of the trajectory whose thread or task runs now (set by `run_program`)
_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("flexmarl_caller", default=None)


def _attribute(request: httpx.Request) -> None:
    """The call is the running trajectory's, whichever of flexmarl's clients carries it; the
    client's own trajectory goes along (`VIA_HEADER`), so the endpoint can count reroutes."""
    own = request.headers.get("authorization", "").removeprefix("Bearer ")
    request.headers[VIA_HEADER] = own.rpartition(".")[2]
    caller = _CALLER.get()
    if caller and caller != own:
        request.headers["authorization"] = f"Bearer {caller}"


async def _aattribute(request: httpx.Request) -> None:
    _attribute(request)


#: one program loads at a time: a second thread would find the first's module in `sys.modules`
#: before its code has run (no function yet)
_LOADING = threading.Lock()


def load_program(spec: str, *, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The function `spec` names: `package.module:function` or `path/to/file.py:function`
    (a relative path from `base_dir`, else the working directory)."""
    with _LOADING:
        return _load_program(spec, base_dir)


def _load_program(spec: str, base_dir: str | Path | None) -> Callable[..., Any]:
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise ProgramError(f"team.program {spec!r}: expected 'module:function' or 'path.py:function'")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            if not path.is_file():
                raise ProgramError(f"team.program {spec!r}: no file {path.absolute()}")
            name = f"flexmarl_program_{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(name, path)
                assert loader_spec is not None and loader_spec.loader is not None
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module
                try:
                    loader_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]  # a later load tries again instead of finding half a module
                    raise
        else:
            module = importlib.import_module(mod_name)
    except ProgramError:
        raise
    except Exception as exc:
        raise ProgramError(f"team.program {spec!r}: cannot load {mod_name!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ProgramError(f"team.program {spec!r}: {mod_name!r} has no function {fn_name!r}")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 2:
        raise ProgramError(f"team.program {spec!r}: the function must take (problem, client); it takes "
                           f"{[p.name for p in params]}")
    return fn


@dataclass
class _Timer:
    """Client-side latency of each call (httpx hooks), paired with its decode seconds."""

    out: list[tuple[float, float]]

    def request(self, request: httpx.Request) -> None:
        request.extensions["flexmarl_t0"] = time.perf_counter()

    def response(self, response: httpx.Response) -> None:
        t0 = response.request.extensions.get("flexmarl_t0")
        if t0 is not None:
            engine = float(response.headers.get("x-flexmarl-engine-ms", 0.0)) / 1e3
            self.out.append((time.perf_counter() - t0, engine))

    async def arequest(self, request: httpx.Request) -> None:
        self.request(request)

    async def aresponse(self, response: httpx.Response) -> None:
        self.response(response)


def _error(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_program(fn: Callable[..., Any], jobs: Sequence[Job], session: Session, gateway: Gateway,
                *, timeout_s: float = 600.0, policy_errors: tuple[str, ...] = ()) -> list[TrajectoryResult]:
    """Every job's trajectory, run concurrently; results in job order. A trajectory that raised
    one of the policy's errors (`api.policy_error_type` with `policy_errors`) says so."""
    trajs = [gateway.open(session, input_id, traj, mb) for input_id, traj, mb, _ in jobs]
    results = [TrajectoryResult(i, tr, mb, None, None) for i, tr, mb, _ in jobs]
    latencies: list[tuple[float, float]] = []
    timer = _Timer(latencies)
    try:
        if inspect.iscoroutinefunction(fn):
            asyncio.run(_run_async(fn, jobs, trajs, results, gateway, timer, timeout_s, policy_errors))
        else:
            _run_threads(fn, jobs, trajs, results, gateway, timer, timeout_s, policy_errors)
        gateway.drain(session)
    finally:
        gateway.close(session)
    for r, t in zip(results, trajs, strict=True):
        r.records = _numbered(t.records)
    _check_routes(trajs, results)
    for r, t in zip(results, trajs, strict=True):
        if r.error is None and t.broken_call is not None:  # the program returned on the broken call
            r.error = (f"MalformedToolCall: agent {t.broken_call!r} ended the trajectory with a tool call that "
                       "does not parse or names a function it was not offered")
            r.policy_error = MalformedToolCall.__name__
    if results:
        results[0].latencies = latencies
    return results


def _numbered(records: list[CallRecord]) -> list[CallRecord]:
    """Each agent's calls numbered by what they are (prompt, occurrence), not arrival: the
    same calls get the same numbers (sample ids, GRPO groups) whatever order they came in."""
    by_agent: dict[str, list[CallRecord]] = {}
    for rec in records:
        by_agent.setdefault(rec.agent, []).append(rec)
    for recs in by_agent.values():
        for k, rec in enumerate(sorted(recs, key=lambda r: r.identity)):
            rec.call = k
    return records


def _check_routes(trajs: list[Trajectory], results: list[TrajectoryResult]) -> None:
    """Calls from clients flexmarl did not make, and a trajectory that answered without a call
    of its own: its calls went out under another trajectory's key. Refused, never recorded."""
    foreign = sum(t.foreign for t in trajs)
    silent = [r for r, t in zip(results, trajs, strict=True) if r.error is None and not t.records]
    if foreign and silent:
        raise ProgramError(
            f"{len(silent)} trajectories answered without a call of their own (e.g. input {silent[0].input_id} "
            f"trajectory {silent[0].traj}) while {foreign} calls came through clients flexmarl did not make: the "
            "program sends its calls around the client each trajectory is given (a client built once from "
            "module-level settings, or shared between trajectories), so they would be recorded under another "
            "trajectory. Use the client the program function receives, or build yours inside the function "
            "from its base_url and api_key (docs/programs.md, 'Whose call is it')")


def _outcome(res: TrajectoryResult, value: Any) -> None:
    if isinstance(value, str):
        res.answer = value
    else:
        res.error = f"TypeError: the program returned {type(value).__name__}, not the answer as a str"


def _failed(res: TrajectoryResult, exc: BaseException, policy_errors: tuple[str, ...]) -> None:
    res.error = _error(exc)
    res.policy_error = policy_error_type(exc, policy_errors)


def _run_threads(fn: Callable[..., Any], jobs: Sequence[Job], trajs: list[Trajectory],
                 results: list[TrajectoryResult], gateway: Gateway, timer: _Timer,
                 timeout_s: float, policy_errors: tuple[str, ...]) -> None:
    def one(k: int) -> None:
        _CALLER.set(trajs[k].key)  # this pool thread runs trajectory k now
        with httpx.Client(timeout=timeout_s, verify=_tls(), limits=_LIMITS,
                          event_hooks={"request": [_attribute, timer.request], "response": [timer.response]}) as http:
            client = openai.OpenAI(base_url=gateway.base_url, api_key=trajs[k].key,
                                   http_client=http, max_retries=0)
            try:
                _outcome(results[k], fn(jobs[k][3], client))
            except BaseException as exc:  # the program's (or the policy's) failure: this trajectory only
                _failed(results[k], exc, policy_errors)
            finally:
                gateway.finish(trajs[k])

    with ThreadPoolExecutor(max_workers=max(len(jobs), 1), thread_name_prefix="flexmarl-program") as pool:
        list(pool.map(one, range(len(jobs))))


async def _run_async(fn: Callable[..., Any], jobs: Sequence[Job], trajs: list[Trajectory],
                     results: list[TrajectoryResult], gateway: Gateway, timer: _Timer,
                     timeout_s: float, policy_errors: tuple[str, ...]) -> None:
    async def one(k: int) -> None:
        _CALLER.set(trajs[k].key)  # this task's context: trajectory k
        async with httpx.AsyncClient(timeout=timeout_s, verify=_tls(), limits=_LIMITS,
                                     event_hooks={"request": [_aattribute, timer.arequest],
                                                  "response": [timer.aresponse]}) as http:
            client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=trajs[k].key,
                                        http_client=http, max_retries=0)
            try:
                _outcome(results[k], await fn(jobs[k][3], client))
            except Exception as exc:
                _failed(results[k], exc, policy_errors)
            finally:
                await asyncio.to_thread(gateway.finish, trajs[k])

    await asyncio.gather(*(one(k) for k in range(len(jobs))))


def check_failures(spec: str, results: Sequence[TrajectoryResult], where: str) -> None:
    """Every trajectory failed, none by the policy's doing: the program is broken, not unlucky.
    (A trajectory the policy broke is trained on: a run of them is a policy still learning.)"""
    if results and all(r.error is not None and r.policy_error is None for r in results):
        first = results[0]
        raise ProgramError(f"{where}: every trajectory of team.program {spec!r} failed; e.g. input "
                           f"{first.input_id} trajectory {first.traj}: {first.error}")
