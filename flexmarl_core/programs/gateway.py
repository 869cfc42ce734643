"""flexmarl's OpenAI-compatible endpoint: an HTTP server in this process that answers a
program's calls from flexmarl's own engines and records every call.

    POST /v1/chat/completions     messages -> the agent's chat template
    POST /v1/completions          a prompt (text or token ids)
    POST /v1/responses            the Responses API, served as chat calls (`responses.py`)
    GET  /v1/models               the team's agents

Each route is an `Api` (`calls.py`): how its body becomes a prompt and its answer a response;
`stream: true` answers as server-sent events cut from the finished response (`stream.py`).

A program gets the endpoint's base URL (`Gateway.base_url`) and its trajectory's key
(`Trajectory.key`: the op's key and the trajectory's token), which says whose call it is;
`model=` is the agent. One base URL for every trajectory: frameworks that keep one HTTP client
per base URL (langchain-openai) then share it instead of building one, with its TLS context,
per trajectory (~35 ms of CPU each). The server is Starlette on uvicorn in a daemon thread,
bound to loopback on a free port, one per process, shared by every program op running here.

Batching: a request waits in its agent's queue until every live trajectory is waiting on a
call (no one left to add to the batch), or no request has joined for a window, then the queue
decodes as one batch on an instance of the agent (`Dispatcher.decode`), each request with its
own sampling and seed. The window is `window_s`, or a tenth of the agent's last decode if that is
longer: where a decode costs seconds, calls that reach the endpoint spread out by a loaded
machine's scheduling still join one decode, and a lone call waits at most a tenth longer. At most `Dispatcher.capacity(agent)` decodes of one agent run at
once; requests arriving meanwhile form the next batch.

Errors are OpenAI's JSON with a 4xx status (bad body, unknown agent or trajectory, a prompt
longer than the model's context, a wrong key or a finished trajectory's); the server never
stops on one. A decode that fails (flexmarl's machinery) is a 503, and the session keeps it:
the op fails on it and is retried; it is never the program's wrong answer.

A call's identity is what it is, not when it arrived: its agent, its prompt's tokens and its
occurrence among identical prompts of the trajectory seed its decode, and number the agent's
calls once the trajectory ends, so concurrent calls (`asyncio.gather`, threads) sample and are
stored alike run after run. Parsing a body, templating and tokenising run on a thread pool, off
the event loop, after a size check that needs no tokenizer: a huge message never holds up
another call.

Tools: a request's `tools` are rendered through the agent's chat template; the answer is read
back by the agent's tool parser (`tools.py`) into `tool_calls` with `finish_reason:
"tool_calls"`; `tool_choice` `required` (or a named function) starts the answer with the
parser's call prefix. A later call that sends the assistant's calls back is rendered with the
answer's exact text (known by its call ids), so it continues the sample token for token.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flexmarl_core.inference.api import Generation
from flexmarl_core.programs.api import (
    CallRecord,
    DecodeGroup,
    DecodeStats,
    Dispatcher,
    MachineryError,
)
from flexmarl_core.programs.calls import APIS, ROUTES, Api, answer, pieces, prepare, remember
from flexmarl_core.programs.protocol import ApiError
from flexmarl_core.programs.session import AgentSpec, Session, Trajectory

__all__ = ["VIA_HEADER", "AgentSpec", "Gateway", "Session", "Trajectory"]

log = logging.getLogger(__name__)

#: a batch waits at most this many windows after its first request
MAX_WAIT_WINDOWS = 25
#: the window grows to this share of the agent's last decode (a slow decode is worth filling)
HOLD_SHARE = 0.1
#: the largest request body the endpoint reads (a larger one is a 413, never parsed)
MAX_BODY_BYTES = 8 << 20
#: the header flexmarl's own clients add: the key of the client object the call went through
VIA_HEADER = "x-flexmarl-via"


@dataclass
class _Waiting:
    session: Session
    group: DecodeGroup
    future: asyncio.Future
    t: float


class Gateway:
    """The endpoint of this process (`Gateway.shared()`); sessions come and go."""

    _shared: Gateway | None = None
    _shared_lock = threading.Lock()

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._tokens: dict[str, Trajectory] = {}
        self._queues: dict[tuple[int, str, int], list[_Waiting]] = {}
        self._in_flight: dict[tuple[int, str, int], int] = {}
        self._timers: set[tuple[int, str, int]] = set()
        #: the last decode's seconds of each agent (by name: an op's first batch gains from the last op's)
        self._decode_s: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="flexmarl-decode")
        #: parsing, templating and tokenising, off the event loop
        self._prep = ThreadPoolExecutor(max_workers=4, thread_name_prefix="flexmarl-prep")
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so, and without it a
        # response (headers, then body) waited ~40 ms for the client's delayed ACK on every call.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # 0: a free port (training); `flexmarl serve` names one
        self.port = self._sock.getsockname()[1]
        app = Starlette(routes=[
            *[Route(api.route, functools.partial(self._handle, api=api), methods=["POST"]) for api in APIS],
            Route("/v1/models", self._models, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error})
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                                     timeout_keep_alive=60))
        self._ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._serve, name="flexmarl-endpoint", daemon=True).start()
        if not self._ready.wait(30) or self.loop is None:
            raise MachineryError(f"the program endpoint did not start on {host}:{self.port}")

    @classmethod
    def shared(cls) -> Gateway:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_until_complete(self._server.serve(sockets=[self._sock]))

    # -- sessions (any thread) ----------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def open(self, session: Session, input_id: str, traj: int, mb: int) -> Trajectory:
        """A new trajectory of `session`; its calls go to `base_url` with `t.key`."""
        t = Trajectory(session, input_id, traj, mb, secrets.token_urlsafe(12))
        session.trajectories[t.token] = t
        self._call(lambda: self._tokens.__setitem__(t.token, t))
        return t

    def finish(self, t: Trajectory) -> None:
        """The program ended this trajectory: it no longer holds a batch back."""
        def done() -> None:
            t.live = False
            self._kick_all()
        self._call(done)

    def close(self, session: Session) -> None:
        """Forget `session`'s trajectories once their calls are all answered."""
        def drop() -> None:
            for tok in session.trajectories:
                self._tokens.pop(tok, None)
        self._call(drop)

    def drain(self, session: Session, timeout: float = 600.0) -> None:
        """Wait until no call of `session` is in flight (a program may return with one)."""
        deadline = time.monotonic() + timeout
        while any(t.pending for t in session.trajectories.values()):
            if time.monotonic() > deadline:
                raise MachineryError(f"calls still unanswered after {timeout:.0f} s")
            time.sleep(0.01)

    def _call(self, fn: Callable[[], None]) -> None:
        assert self.loop is not None
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()
        self.loop.call_soon_threadsafe(run)
        done.wait()

    # -- HTTP (the loop's thread) --------------------------------------------------------------
    async def _http_error(self, request: Request, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        served = f"; this endpoint serves {', '.join(ROUTES)}" if status in (404, 405) else ""
        err = ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'error')}{served}",
                       code="unknown_url" if status == 404 else None)
        return JSONResponse(err.body(), status_code=status)

    def _trajectory(self, request: Request) -> Trajectory:
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        t = self._tokens.get(key.rpartition(".")[2])
        if t is None or not secrets.compare_digest(key, t.key):
            raise ApiError(401, "Incorrect API key provided, or its trajectory has ended: use the key flexmarl "
                           "gave this program", type_="invalid_request_error", code="invalid_api_key")
        return t

    async def _models(self, request: Request) -> JSONResponse:
        try:
            t = self._trajectory(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        data = [{"id": a, "object": "model", "created": 0, "owned_by": "flexmarl"} for a in t.session.agents]
        return JSONResponse({"object": "list", "data": data})

    async def _handle(self, request: Request, api: Api) -> Response:
        t0 = time.perf_counter()
        t: Trajectory | None = None
        try:
            t = self._trajectory(request)
            via = request.headers.get(VIA_HEADER)
            if via is None:
                t.foreign += 1
            elif via != t.token:
                t.rerouted += 1
            size = int(request.headers.get("content-length") or 0)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is {size} bytes, more than the {MAX_BODY_BYTES} the endpoint "
                               "reads: send a shorter prompt", code="request_too_large")
            raw = await request.body()
            s = t.session
            assert self.loop is not None
            req, prompt_ids, prompt_text, prefix = await self.loop.run_in_executor(
                self._prep, prepare, raw, api, s, t)
            spec = s.agents[req.agent]
            sampling = req.sampling.model_copy(update={"temperature": 0.0}) if s.greedy else req.sampling
            digest = hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest()[:16]
            occ = t.seen.get((req.agent, digest), 0)
            t.seen[(req.agent, digest)] = occ + req.n
            seed = req.seed if req.seed is not None else s.seed_of(t.input_id, t.traj, req.agent, f"{digest}:{occ}")
            after, started = tuple(range(len(t.records))), time.time()
            t.pending += 1
            t_queued = time.perf_counter()
            try:
                group = DecodeGroup(tuple(prompt_ids), sampling, seed, req.n, (t.input_id, t.traj))
                gens, stats = await self._submit(s, req.agent, group)
            finally:
                t.pending -= 1
            ended = time.time()
            answers = []
            for k, g in enumerate(gens):
                t.records.append(CallRecord(req.agent, len(t.records), list(prompt_ids), prompt_text, g, started,
                                            ended, after, (tuple(prompt_ids), occ + k)))
                answers.append(answer(t, req, spec, prefix + g.text, f"{digest}:{occ + k}"))
            engine_s = time.perf_counter() - t_queued
            out = api.respond(req, len(prompt_ids), gens, spec.tokenizer.decode, s.fingerprint, answers)
            remember(t, req, out, answers[0])
            headers = {"x-flexmarl-decode-ms": f"{stats.seconds * 1e3:.3f}",
                       "x-flexmarl-engine-ms": f"{engine_s * 1e3:.3f}"}
            if req.stream:
                text = functools.partial(spec.tokenizer.decode, skip_special_tokens=True)
                events = "".join(api.events(out, req, pieces(gens, answers, text)))
                s.overheads.append(max(time.perf_counter() - t0 - engine_s, 0.0))
                return Response(events, media_type="text/event-stream", headers=headers)
            s.overheads.append(max(time.perf_counter() - t0 - engine_s, 0.0))
            return JSONResponse(out, headers=headers)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except MachineryError as e:
            if t is not None and t.session.error is None:
                t.session.error = e
            return JSONResponse(ApiError(503, str(e), type_="server_error").body(), status_code=503)
        except Exception as e:  # the endpoint answers every request; the op sees the session's error
            log.exception("program endpoint: %s %s", request.method, request.url.path)
            if t is not None and t.session.error is None:
                t.session.error = MachineryError(f"endpoint failure: {type(e).__name__}: {e}")
            return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", type_="server_error").body(),
                                status_code=500)

    # -- batching (the loop's thread) ------------------------------------------------------------
    def _submit(self, s: Session, agent: str, group: DecodeGroup) -> asyncio.Future:
        assert self.loop is not None
        fut = self.loop.create_future()
        key = (id(s.dispatcher), agent, s.versions[agent])
        self._queues.setdefault(key, []).append(_Waiting(s, group, fut, time.monotonic()))
        self._kick(key)
        return fut

    def _everyone_waits(self) -> bool:
        return all(t.pending > 0 for t in self._tokens.values() if t.live)

    def _kick_all(self) -> None:
        for key in list(self._queues):
            self._kick(key)

    def _kick(self, key: tuple[int, str, int]) -> None:
        queue = self._queues.get(key)
        if not queue:
            return
        s = queue[0].session
        if self._in_flight.get(key, 0) >= max(s.dispatcher.capacity(key[1]), 1):
            return  # the next batch forms while this one decodes
        # Debounced: a batch waits while requests keep arriving (each within a window of the
        # last), up to `MAX_WAIT_WINDOWS` windows after its first and never longer than a decode.
        now = time.monotonic()
        last = self._decode_s.get(key[1], 0.0)
        window = max(s.window_s, HOLD_SHARE * last)
        hold = max(MAX_WAIT_WINDOWS * s.window_s, min(MAX_WAIT_WINDOWS * window, last))
        wait = min(queue[-1].t + window, queue[0].t + hold) - now
        if wait > 0 and not self._everyone_waits():
            if key not in self._timers:
                self._timers.add(key)
                assert self.loop is not None
                self.loop.call_later(wait, self._timer, key)
            return
        batch = self._queues.pop(key)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        assert self.loop is not None
        job = self.loop.run_in_executor(self._pool, self._decode, s.dispatcher, key[1], key[2],
                                        [w.group for w in batch])
        job.add_done_callback(lambda j: self._decoded(key, batch, j))

    def _timer(self, key: tuple[int, str, int]) -> None:
        self._timers.discard(key)
        self._kick(key)

    @staticmethod
    def _decode(dispatcher: Dispatcher, agent: str, version: int,
                groups: list[DecodeGroup]) -> tuple[list[list[Generation]], DecodeStats]:
        stats = DecodeStats()
        outs = dispatcher.decode(agent, version, groups, stats)
        if len(outs) != len(groups) or any(len(o) != g.n for o, g in zip(outs, groups, strict=True)):
            raise MachineryError(f"agent {agent!r}: the decode returned {[len(o) for o in outs]} generations "
                                 f"for requests of {[g.n for g in groups]}")
        return outs, stats

    def _decoded(self, key: tuple[int, str, int], batch: list[_Waiting], job: asyncio.Future) -> None:
        self._in_flight[key] -= 1
        exc = job.exception()
        if exc is None:
            outs, stats = job.result()
            self._decode_s[key[1]] = stats.seconds
            batch[0].session.decodes.append((key[1], len(batch), sum(w.group.n for w in batch), stats))
        for i, w in enumerate(batch):
            if w.future.done():
                continue
            if exc is None:
                w.future.set_result((outs[i], stats))
            else:
                w.future.set_exception(exc if isinstance(exc, MachineryError) else MachineryError(
                    f"agent {key[1]!r}: decode failed: {type(exc).__name__}: {exc}"))
        self._kick_all()
