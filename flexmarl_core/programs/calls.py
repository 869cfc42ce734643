"""From a request body to the prompt an engine decodes, and from what it sampled to what the
program reads: one `Api` per route the endpoint serves (chat completions, completions, the
Responses API), each a parser, a response builder and a stream of server-sent events.

Everything here runs off the endpoint's event loop (the prep pool) or is pure formatting."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation
from flexmarl_core.programs import responses, stream
from flexmarl_core.programs.chat import PLAIN, ChatTemplateError, render
from flexmarl_core.programs.protocol import (
    Answer,
    ApiError,
    CallRequest,
    chat_response,
    completion_response,
    parse_chat,
    parse_completion,
)
from flexmarl_core.programs.session import AgentSpec, Session, Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Api:
    """One route: `parse(body, agents' sampling, the trajectory's conversations)` ->
    request; `respond(req, prompt length, generations, decode, fingerprint, answers)` -> the
    response body; `events(body, req, pieces)` -> its server-sent events when `stream` is set."""

    route: str
    parse: Callable[[Any, Mapping[str, SamplingConfig], Mapping[str, list[dict[str, Any]]]], CallRequest]
    respond: Callable[..., dict[str, Any]]
    events: Callable[[dict[str, Any], CallRequest, list[list[stream.Piece]]], Iterator[str]]


APIS: tuple[Api, ...] = (
    Api("/v1/chat/completions", lambda b, d, _c: parse_chat(b, d), chat_response, stream.chat_events),
    Api("/v1/completions", lambda b, d, _c: parse_completion(b, d), completion_response, stream.completion_events),
    Api("/v1/responses", responses.parse_responses, responses.response_body, responses.response_events),
)
ROUTES = [f"POST {a.route}" for a in APIS] + ["GET /v1/models"]

#: agents already warned that `plain` runs a chat's roles together (once per process)
_PLAIN_WARNED: set[str] = set()


def prepare(raw: bytes, api: Api, s: Session, t: Trajectory) -> tuple[CallRequest, list[int], str, str]:
    """(request, prompt ids, prompt text, the answer's forced start) of one body, on a
    thread of the prep pool."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    req = api.parse(body, s.defaults, t.conversations)
    spec = s.agents[req.agent]
    with spec.lock:
        ids, text, prefix = prompt(req, spec, t.answers)
    return req, ids, text, prefix


def prompt(req: CallRequest, spec: AgentSpec, answers: dict[str, str] | None = None) -> tuple[list[int], str, str]:
    """(prompt ids, prompt text, the answer's forced start: a call's prefix when
    `tool_choice` requires one)."""
    tok = spec.tokenizer
    prefix = ""
    where = "messages" if req.kind == "chat" else "prompt"
    if req.kind == "chat":
        messages = _replayed(req.messages or [], answers or {})
        _warn_plain(spec, messages)
        try:
            text = render(spec.template, messages, tok, tools=req.tools, parser=spec.parser)
        except ChatTemplateError as e:
            raise ApiError(400, f"agent {spec.name!r}: {e}", "messages") from None
        if req.tool_choice in ("required", "function"):
            prefix = spec.parser.forced_prefix(req.tool_function)
            text += prefix
        _fits(spec, req, len(text.encode()), where)
        ids = tok.encode(text, add_special_tokens=False)
    elif isinstance(req.prompt, str):
        _fits(spec, req, len(req.prompt.encode()), where)
        text, ids = req.prompt, tok.encode(req.prompt, add_special_tokens=False)
    else:
        ids = list(req.prompt or [])
        vocab = len(tok)
        if max(ids) >= vocab:
            raise ApiError(400, f"'prompt' has token id {max(ids)}, beyond the vocabulary of agent "
                           f"{spec.name!r} ({vocab} tokens)", "prompt")
        text = tok.decode(ids, skip_special_tokens=False)
    if not ids:
        raise ApiError(400, "the prompt is empty after templating: nothing to continue from", where)
    room = spec.max_context - len(ids)
    if room < req.sampling.max_new_tokens:
        raise ApiError(400, f"This model's maximum context length is {spec.max_context} tokens; the prompt "
                       f"has {len(ids)} and max_tokens is {req.sampling.max_new_tokens} (agent {spec.name!r})",
                       where, code="context_length_exceeded")
    return ids, text, prefix


def answer(t: Trajectory, req: CallRequest, spec: AgentSpec, text: str, identity: str) -> Answer:
    """One choice as the program reads it: its text, or its tool calls (ids derived from the
    call's identity, the answer's text kept under them for the call that sends them back)."""
    if not req.tools or req.tool_choice == "none":
        t.broken_call = None
        return Answer(text, [], None)
    content, calls = spec.parser.extract(text)
    offered = {tool["name"] for tool in req.tools}
    if not calls or any(c.name not in offered for c in calls):
        # a call of a function the request did not offer is text, as with a malformed one:
        # the program sees what the model wrote; if the trajectory ends on it, the model broke
        # it (`runner.py`, MalformedToolCall)
        t.broken_call = req.agent if calls or spec.parser.attempted(text) else None
        return Answer(text, [], None)
    t.broken_call = None
    if not req.parallel_tool_calls:
        calls = calls[:1]
    out = []
    for j, c in enumerate(calls):
        cid = "call_" + hashlib.sha1(f"{t.input_id}:{t.traj}:{req.agent}:{identity}:{j}".encode()).hexdigest()[:24]
        t.answers[cid] = text
        out.append({"id": cid, "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
    return Answer(content or None, out, "tool_calls")


def remember(t: Trajectory, req: CallRequest, body: dict[str, Any], first: Answer) -> None:
    """A Responses call's conversation through its answer, for a later `previous_response_id`."""
    if req.carry is None:
        return
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in first.tool_calls]
    turn: dict[str, Any] = {"role": "assistant", "content": first.content or ""}
    if calls:
        turn["tool_calls"] = calls
    t.conversations[body["id"]] = [*req.carry, turn]


def pieces(gens: Sequence[Generation], answers: Sequence[Answer], decode: Callable[[list[int]], str]
           ) -> list[list[stream.Piece]]:
    """Per choice, its content cut where its tokens end (what a stream sends chunk by chunk)."""
    return [stream.split(a.content or "", g.response_ids, decode) if a.content else []
            for g, a in zip(gens, answers, strict=True)]


def _warn_plain(spec: AgentSpec, messages: Sequence[dict[str, Any]]) -> None:
    if spec.template == PLAIN and len({m["role"] for m in messages}) > 1 and spec.name not in _PLAIN_WARNED:
        _PLAIN_WARNED.add(spec.name)
        log.warning("agent %r: chat_template 'plain' runs a chat's roles together (%s): set "
                    "team.agents.%s.chat_template to 'chatml' or 'tokenizer' for a chat model",
                    spec.name, "/".join(dict.fromkeys(m["role"] for m in messages)), spec.name)


def _replayed(messages: list[dict[str, Any]], answers: dict[str, str]) -> list[dict[str, Any]]:
    """`messages` with every assistant turn whose tool calls this trajectory's answers made
    written as that answer's exact text: the prompt then continues the answer token for token."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and all(c["id"] in answers for c in calls) and len({answers[c["id"]] for c in calls}) == 1:
            m = {"role": "assistant", "content": answers[calls[0]["id"]]}
        out.append(m)
    return out


def _fits(spec: AgentSpec, req: CallRequest, nbytes: int, where: str) -> None:
    """A text of `nbytes` UTF-8 bytes has at least `nbytes / max_token_bytes` tokens: past the
    context, it is refused before the tokenizer reads it."""
    at_least = -(-nbytes // spec.max_token_bytes)
    if at_least + req.sampling.max_new_tokens > spec.max_context:
        raise ApiError(400, f"This model's maximum context length is {spec.max_context} tokens; the prompt has at "
                       f"least {at_least} ({nbytes} bytes) and max_tokens is {req.sampling.max_new_tokens} (agent "
                       f"{spec.name!r}): send a shorter prompt", where, code="context_length_exceeded")
