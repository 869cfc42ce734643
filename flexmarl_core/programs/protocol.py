"""The OpenAI wire format flexmarl's endpoint speaks: request bodies in, response bodies out.

`parse_chat` / `parse_completion` turn a JSON body into a `CallRequest` (or raise `ApiError`,
which the endpoint returns as OpenAI's error JSON). Honoured: `temperature`, `top_p`,
`max_tokens` (`max_completion_tokens`), `stop`, `n`, `logprobs`, `seed`, `stream` (with
`stream_options.include_usage`; events in `stream.py`), and on chat `response_format` (JSON
by constrained decoding), `tools`,
`tool_choice` (`auto`, `none`, `required`, a named function) and `parallel_tool_calls`, with
assistant messages that carry `tool_calls` and `tool` messages that answer them. A field the
engines cannot honour (`top_logprobs` > 0, penalties, `logit_bias`, images, ...) is a 400 that
names it and what to use instead, never silently ignored; a value outside OpenAI's own range
(`temperature` above 2, `top_p` above 1) is refused as OpenAI refuses it. Fields that change nothing
(`user`, `metadata`, `store`, `service_tier`, ...) are accepted. What the request leaves out
comes from the agent's `sampling` in the config.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation
from flexmarl_core.programs.chat import ROLES

Kind = Literal["chat", "completion"]

#: fields accepted and ignored: they do not change what is sampled
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
#: fields accepted only at their no-op value
_NOOP: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "functions": (None, []), "function_call": (None, "none", "auto"), "top_logprobs": (None, 0),
    "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "modalities": (None, ["text"]), "reasoning_effort": (None,),
}
_SAMPLING = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed", "stream",
             "stream_options")
#: OpenAI's own bounds of a value (it refuses what lies outside)
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}
CHAT_FIELDS = frozenset({"model", "messages", "logprobs", "tools", "tool_choice", "parallel_tool_calls",
                         "response_format", *_SAMPLING}) | _IGNORED | _NOOP.keys()
COMPLETION_FIELDS = frozenset({"model", "prompt", "logprobs", *_SAMPLING}) | _IGNORED | _NOOP.keys()
#: the most choices one request may ask for (each is a row of the decode batch)
MAX_N = 64


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class CallRequest:
    """One validated request for one agent."""

    kind: Kind
    agent: str
    sampling: SamplingConfig
    n: int = 1
    seed: int | None = None
    #: chat: the messages (role, content; an assistant's `tool_calls`, a tool's `tool_call_id`);
    #: completion: None
    messages: list[dict[str, Any]] | None = None
    #: completion: the prompt as text, or as token ids
    prompt: str | list[int] | None = None
    #: chat: `logprobs: true`; completion: `logprobs: 0/1`
    logprobs: bool = False
    #: chat: the functions the model may call (`{"name", "description", "parameters"}` each)
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: `auto` (the model decides), `none` (no call), `required` (a call), or `function`
    tool_choice: str = "auto"
    #: the function `tool_choice` names
    tool_function: str | None = None
    #: more than one call in one answer
    parallel_tool_calls: bool = True
    #: answer as server-sent events (`stream.py`), with a last usage chunk when `include_usage`
    stream: bool = False
    include_usage: bool = False
    #: Responses API: the conversation a later `previous_response_id` continues (without the
    #: request's `instructions`, which OpenAI does not carry over); None for the other APIs
    carry: list[dict[str, Any]] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


#: what to use instead of a field the engines cannot honour
_INSTEAD = {
    "functions": "send 'tools' (the successor of 'functions')",
    "function_call": "send 'tool_choice' (the successor of 'function_call')",
    "top_logprobs": "ask for 'logprobs': true (the sampled token's log-prob)",
    "logit_bias": "leave it out; steer with the prompt or the agent's sampling config",
    "presence_penalty": "leave it out (the engines sample from the model's own distribution)",
    "frequency_penalty": "leave it out (the engines sample from the model's own distribution)",
    "best_of": "ask for 'n' choices and pick among them in the program",
    "echo": "keep the prompt in the program",
    "suffix": "put the suffix in the prompt",
    "modalities": "send text",
}


def _brief(value: Any) -> str:
    """A value for an error message: short, never a whole schema."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(body: Mapping[str, Any], allowed: Collection[str], noop: Mapping[str, tuple[Any, ...]] = _NOOP,
                 instead: Mapping[str, str] = _INSTEAD) -> None:
    """A 400 for a field the route does not serve, or a value of a no-op field its engines do
    not take, naming the supported way (`instead`)."""
    for key, value in body.items():
        if key not in allowed:
            raise ApiError(400, f"unsupported field {key!r}: flexmarl's endpoint does not implement it; "
                           f"{instead.get(key, 'leave it out')}", key, code="unsupported_parameter")
        if key in noop and value not in noop[key]:
            raise ApiError(400, f"unsupported value of {key!r} ({_brief(value)}): flexmarl's engines take only "
                           f"{list(noop[key])}; {instead.get(key, 'leave it out')}", key, code="unsupported_value")


def _agent(body: Mapping[str, Any], agents: Mapping[str, SamplingConfig]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "missing 'model': set it to an agent name", "model")
    if model not in agents:
        raise ApiError(404, f"The model {model!r} does not exist: this team's agents are {sorted(agents)}",
                       "model", code="model_not_found")
    return model


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) of a body."""
    on, opts = body.get("stream"), body.get("stream_options")
    if on not in (None, True, False):
        raise ApiError(400, f"invalid 'stream' ({_brief(on)}): true or false", "stream")
    if opts is not None and (not isinstance(opts, dict) or opts.get("include_usage") not in (None, True, False)):
        raise ApiError(400, "'stream_options' must be {'include_usage': true or false}", "stream_options")
    if opts and not on:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    return bool(on), bool((opts or {}).get("include_usage"))


def _sampling(body: Mapping[str, Any], default: SamplingConfig) -> tuple[SamplingConfig, int, int | None]:
    for key, (lo, hi) in _RANGES.items():
        v = body.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and not lo <= v <= hi:
            raise ApiError(400, f"Invalid '{key}': {v} is outside [{lo:g}, {hi:g}]", key,
                           code="decimal_above_max_value" if v > hi else "decimal_below_min_value")
    upd: dict[str, Any] = {}
    for key, to in (("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_new_tokens"),
                    ("max_completion_tokens", "max_new_tokens")):
        if body.get(key) is not None:
            upd[to] = body[key]
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        upd["stop"] = stop
    try:
        sampling = SamplingConfig(**{**default.model_dump(), **upd})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = {"max_new_tokens": "max_tokens"}.get(str(err["loc"][0]), str(err["loc"][0]))
        raise ApiError(400, f"invalid {name!r}: {err['msg']} (got {err.get('input')!r})", name) from None
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ApiError(400, f"invalid 'n' ({n!r}): an integer from 1 to {MAX_N}", "n")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError(400, f"invalid 'seed' ({seed!r}): an integer", "seed")
    return sampling, n, seed


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, as `{"id", "name", "arguments"}` (arguments parsed)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                           "{'name', 'arguments'}}", f"{where}.tool_calls")
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments must be a JSON object (as a "
                           "string)", f"{where}.tool_calls")
        out.append({"id": str(c.get("id") or ""), "name": fn["name"], "arguments": parsed})
    return out


def _content(i: int, msg: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise ApiError(400, f"{where} must be an object with 'role' and 'content'", where)
    role = msg.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role {role!r} is not one of {list(ROLES)}", f"{where}.role")
    if msg.get("function_call"):
        raise ApiError(400, f"{where}.function_call is not supported: send 'tool_calls' (its successor)",
                       f"{where}.function_call", code="unsupported_parameter")
    extra: dict[str, Any] = {}
    if role == "assistant" and msg.get("tool_calls"):
        extra["tool_calls"] = _tool_calls(where, msg["tool_calls"])
    if role == "tool":
        extra["tool_call_id"] = str(msg.get("tool_call_id") or "")
    content = msg.get("content")
    if isinstance(content, list):  # content parts: text only
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}.content[{j}]: only text parts are supported",
                               f"{where}.content", code="unsupported_value")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": role, "content": content, **extra}


def _tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str, str | None, bool]:
    """(tools, tool_choice, the function it names, parallel_tool_calls) of a chat body."""
    tools = []
    for j, t in enumerate(body.get("tools") or []):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{j}] must be {{'type': 'function', 'function': {{'name', 'description', "
                           "'parameters'}}}} (function tools only)", "tools", code="unsupported_value")
        tools.append({"name": fn["name"], "description": fn.get("description") or "",
                      "parameters": fn.get("parameters") or {"type": "object", "properties": {}}})
    names = [t["name"] for t in tools]
    choice, function = body.get("tool_choice"), None
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
                           "'function': {'name': ...}}", "tool_choice")
        choice, function = "function", fn["name"]
    if choice not in ("auto", "none", "required", "function"):
        raise ApiError(400, f"'tool_choice' {_brief(choice)} is not 'auto', 'none', 'required' or a named "
                       "function", "tool_choice")
    if choice in ("required", "function") and not tools:
        raise ApiError(400, f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
    if function is not None and function not in names:
        raise ApiError(400, f"'tool_choice' names {function!r}, which is not among 'tools': {names}", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return tools, choice, function, parallel is not False


def json_schema_of(fmt: Any, field: str = "response_format") -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks for (None: text): `json_object` is any JSON
    object, `json_schema` its `schema`; decoding then follows it (`inference/constrained.py`)."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests it; the Responses API's `text.format` does not
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            return schema
        raise ApiError(400, f"'{field}' of type json_schema needs a JSON schema object in 'schema'", field)
    raise ApiError(400, f"'{field}' type {_brief(kind)} is not 'text', 'json_object' or 'json_schema'", field,
                   code="unsupported_value")


def parse_chat(body: Any, agents: Mapping[str, SamplingConfig]) -> CallRequest:
    """A `/v1/chat/completions` body; `agents` maps each agent to its sampling defaults."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, CHAT_FIELDS)
    agent = _agent(body, agents)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    sampling, n, seed = _sampling(body, agents[agent])
    schema = json_schema_of(body.get("response_format"))
    if schema is not None:
        sampling = sampling.model_copy(update={"json_schema": schema})
    logprobs = body.get("logprobs")
    if logprobs not in (None, True, False):
        raise ApiError(400, f"invalid 'logprobs' ({logprobs!r}): true or false", "logprobs")
    tools, choice, function, parallel = _tools(body)
    on, usage = _stream(body)
    return CallRequest("chat", agent, sampling, n, seed, messages=[_content(i, m) for i, m in enumerate(messages)],
                       logprobs=bool(logprobs), tools=tools, tool_choice=choice, tool_function=function,
                       parallel_tool_calls=parallel, stream=on, include_usage=usage)


def parse_completion(body: Any, agents: Mapping[str, SamplingConfig]) -> CallRequest:
    """A `/v1/completions` body: one prompt, as text or token ids."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, COMPLETION_FIELDS)
    agent = _agent(body, agents)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    ok = (isinstance(prompt, str) and prompt) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in prompt))
    if not ok:
        raise ApiError(400, "'prompt' must be one non-empty string or one list of token ids (batches of "
                       "prompts are not supported: send one request per prompt)", "prompt")
    sampling, n, seed = _sampling(body, agents[agent])
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise ApiError(400, f"unsupported 'logprobs' ({logprobs!r}): 0 or 1 (the sampled token's log-prob; "
                       "top-k alternatives are not computed)", "logprobs", code="unsupported_value")
    on, usage = _stream(body)
    return CallRequest("completion", agent, sampling, n, seed, prompt=prompt, logprobs=logprobs is not None,
                       stream=on, include_usage=usage)


@dataclass(frozen=True, slots=True)
class Answer:
    """One choice as the program reads it: its text (None when it is only calls), its tool
    calls in OpenAI's form, and `tool_calls` as its finish reason when it made some."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


def _finish(g: Generation, answer: Answer | None = None) -> str:
    if answer is not None and answer.finish_reason:
        return answer.finish_reason
    return "length" if g.finish_reason == "length" else "stop"


def _usage(prompt_len: int, gens: Sequence[Generation]) -> dict[str, int]:
    out = sum(len(g.response_ids) for g in gens)
    return {"prompt_tokens": prompt_len, "completion_tokens": out, "total_tokens": prompt_len + out}


def _sampled(g: Generation) -> list[tuple[int, float]]:
    mask = g.loss_mask or [1] * len(g.response_ids)
    return [(t, lp) for t, lp, m in zip(g.response_ids, g.logprobs, mask, strict=True) if m]


def chat_response(req: CallRequest, prompt_len: int, gens: Sequence[Generation], decode: Any,
                  fingerprint: str, answers: Sequence[Answer] | None = None) -> dict[str, Any]:
    """`chat.completion` for `gens` (one per choice; `answers`: what each says, its tool calls
    parsed); `decode(ids) -> str` for token strings."""
    choices = []
    for i, g in enumerate(gens):
        answer = answers[i] if answers else Answer(g.text, [], None)
        lp = None
        if req.logprobs:
            content = []
            for t, v in _sampled(g):
                s = decode([t])
                content.append({"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": []})
            lp = {"content": content, "refusal": None}
        message: dict[str, Any] = {"role": "assistant", "content": answer.content, "refusal": None}
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        choices.append({"index": i, "message": message, "finish_reason": _finish(g, answer), "logprobs": lp})
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": req.created, "model": req.agent,
            "system_fingerprint": fingerprint, "choices": choices, "usage": _usage(prompt_len, gens)}


def completion_response(req: CallRequest, prompt_len: int, gens: Sequence[Generation], decode: Any,
                        fingerprint: str, answers: Sequence[Answer] | None = None) -> dict[str, Any]:
    """`text_completion` for `gens` (one per choice)."""
    choices = []
    for i, g in enumerate(gens):
        lp = None
        if req.logprobs:
            pairs = _sampled(g)
            tokens = [decode([t]) for t, _ in pairs]
            offsets, at = [], 0
            for s in tokens:
                offsets.append(at)
                at += len(s)
            lp = {"tokens": tokens, "token_logprobs": [v for _, v in pairs],
                  "top_logprobs": [{s: v} for s, (_, v) in zip(tokens, pairs, strict=True)], "text_offset": offsets}
        choices.append({"index": i, "text": g.text, "finish_reason": _finish(g), "logprobs": lp})
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": req.agent,
            "system_fingerprint": fingerprint, "choices": choices, "usage": _usage(prompt_len, gens)}
