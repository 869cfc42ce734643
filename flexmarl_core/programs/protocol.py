"""The OpenAI wire format flexmarl's endpoint speaks: request bodies in, response bodies out.

`parse_chat` / `parse_completion` turn a JSON body into a `CallRequest` (or raise `ApiError`,
which the endpoint returns as OpenAI's error JSON). Honoured: `temperature`, `top_p`,
`max_tokens` (`max_completion_tokens`), `stop`, `n`, `logprobs` and `seed`; a field the engines
cannot honour (`top_logprobs` > 0, penalties, `logit_bias`, tools, streaming, images, ...) is a
400 that names it, never silently ignored. Fields that change nothing (`user`, `metadata`,
`store`, `service_tier`, ...) are accepted. What the request leaves out comes from the agent's
`sampling` in the config.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation
from flexmarl_core.programs.chat import ROLES

Kind = Literal["chat", "completion"]

#: fields accepted and ignored: they do not change what is sampled
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
                      "prompt_cache_key", "safety_identifier"})
#: fields accepted only at their no-op value
_NOOP: dict[str, tuple[Any, ...]] = {
    "stream": (None, False), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "modalities": (None, ["text"]), "reasoning_effort": (None,),
}
_SAMPLING = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed")
CHAT_FIELDS = frozenset({"model", "messages", "logprobs", *_SAMPLING}) | _IGNORED | _NOOP.keys()
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
    #: chat: the messages (role, content); completion: None
    messages: list[dict[str, str]] | None = None
    #: completion: the prompt as text, or as token ids
    prompt: str | list[int] | None = None
    #: chat: `logprobs: true`; completion: `logprobs: 0/1`
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for key, value in body.items():
        if key not in allowed:
            raise ApiError(400, f"unsupported field {key!r}: flexmarl's endpoint does not implement it", key,
                           code="unsupported_parameter")
        if key in _NOOP and value not in _NOOP[key]:
            raise ApiError(400, f"unsupported value of {key!r} ({value!r}): only {list(_NOOP[key])} are "
                           "supported by flexmarl's engines", key, code="unsupported_value")


def _agent(body: Mapping[str, Any], agents: Mapping[str, SamplingConfig]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "missing 'model': set it to an agent name", "model")
    if model not in agents:
        raise ApiError(404, f"The model {model!r} does not exist: this team's agents are {sorted(agents)}",
                       "model", code="model_not_found")
    return model


def _sampling(body: Mapping[str, Any], default: SamplingConfig) -> tuple[SamplingConfig, int, int | None]:
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


def _content(i: int, msg: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise ApiError(400, f"{where} must be an object with 'role' and 'content'", where)
    role = msg.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role {role!r} is not one of {list(ROLES)}", f"{where}.role")
    if msg.get("tool_calls") or msg.get("function_call"):
        raise ApiError(400, f"{where}: tool calls are not supported", f"{where}.tool_calls",
                       code="unsupported_parameter")
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
    return {"role": role, "content": content}


def parse_chat(body: Any, agents: Mapping[str, SamplingConfig]) -> CallRequest:
    """A `/v1/chat/completions` body; `agents` maps each agent to its sampling defaults."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    agent = _agent(body, agents)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    sampling, n, seed = _sampling(body, agents[agent])
    logprobs = body.get("logprobs")
    if logprobs not in (None, True, False):
        raise ApiError(400, f"invalid 'logprobs' ({logprobs!r}): true or false", "logprobs")
    return CallRequest("chat", agent, sampling, n, seed, messages=[_content(i, m) for i, m in enumerate(messages)],
                       logprobs=bool(logprobs))


def parse_completion(body: Any, agents: Mapping[str, SamplingConfig]) -> CallRequest:
    """A `/v1/completions` body: one prompt, as text or token ids."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
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
    return CallRequest("completion", agent, sampling, n, seed, prompt=prompt, logprobs=logprobs is not None)


def _finish(g: Generation) -> str:
    return "length" if g.finish_reason == "length" else "stop"


def _usage(prompt_len: int, gens: Sequence[Generation]) -> dict[str, int]:
    out = sum(len(g.response_ids) for g in gens)
    return {"prompt_tokens": prompt_len, "completion_tokens": out, "total_tokens": prompt_len + out}


def _sampled(g: Generation) -> list[tuple[int, float]]:
    mask = g.loss_mask or [1] * len(g.response_ids)
    return [(t, lp) for t, lp, m in zip(g.response_ids, g.logprobs, mask, strict=True) if m]


def chat_response(req: CallRequest, prompt_len: int, gens: Sequence[Generation], decode: Any,
                  fingerprint: str) -> dict[str, Any]:
    """`chat.completion` for `gens` (one per choice); `decode(ids) -> str` for token strings."""
    choices = []
    for i, g in enumerate(gens):
        lp = None
        if req.logprobs:
            content = []
            for t, v in _sampled(g):
                s = decode([t])
                content.append({"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": []})
            lp = {"content": content, "refusal": None}
        choices.append({"index": i, "message": {"role": "assistant", "content": g.text, "refusal": None},
                        "finish_reason": _finish(g), "logprobs": lp})
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": req.created, "model": req.agent,
            "system_fingerprint": fingerprint, "choices": choices, "usage": _usage(prompt_len, gens)}


def completion_response(req: CallRequest, prompt_len: int, gens: Sequence[Generation], decode: Any,
                        fingerprint: str) -> dict[str, Any]:
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
