"""The Responses API (`POST /v1/responses`): the subset the OpenAI Agents SDK's default model
and other Responses clients use, served as chat calls and recorded exactly as they are.

A request's `instructions` become a system message, its `input` items the messages after it:
a message (text parts), a `function_call` (the assistant's tool call, merged into the
assistant turn before it) and a `function_call_output` (a tool message). `previous_response_id`
continues a response of the same trajectory: its conversation through its answer comes first
(its `instructions` are not carried, as OpenAI does not carry them). The answer is a `message`
output item and a `function_call` item per tool call, the call ids the chat API would give, so
a later request that sends them back continues the sample token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation
from flexmarl_core.programs.protocol import (
    Answer,
    ApiError,
    CallRequest,
    check_fields,
    json_schema_of,
    parse_chat,
)
from flexmarl_core.programs.stream import Piece

#: accepted and ignored: they do not change what is sampled
_IGNORED = frozenset({"store", "metadata", "user", "prompt_cache_key", "safety_identifier", "service_tier"})
#: accepted only at these values
_NOOP: dict[str, tuple[Any, ...]] = {
    "include": (None, []), "truncation": (None, "disabled"), "reasoning": (None, {}, {"effort": None}),
    "top_logprobs": (None, 0), "background": (None, False),
    "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
}
_INSTEAD = {
    "conversation": "chain calls with 'previous_response_id' (a trajectory's own responses)",
    "background": "call synchronously: every call is answered in one decode batch",
}
_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                     "temperature", "top_p", "max_output_tokens", "stream", "stream_options",
                     "previous_response_id", "text"}) | _IGNORED | _NOOP.keys()


def _text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}.content[{j}]: only text parts are supported (got {kind!r})",
                               f"{where}.content", code="unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _messages(items: Any) -> list[dict[str, Any]]:
    """`input` as chat messages (OpenAI's chat wire form)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and "role" in item:
            out.append({"role": item["role"], "content": _text(where, item.get("content"))})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the turn's calls follow its text
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": output if isinstance(output, str) else _text(where, output)})
        else:
            raise ApiError(400, f"{where}: items of type {kind!r} are not supported; send messages, "
                           "'function_call' and 'function_call_output' items", where, code="unsupported_value")
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", "tools")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ApiError(400, f"tools[{j}]: only function tools are supported (got {kind!r}); hosted tools "
                           "(web search, file search, computer use) have no engine here", "tools",
                           code="unsupported_value")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                      if t.get(k) is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def parse_responses(body: Any, agents: Mapping[str, SamplingConfig],
                    conversations: Mapping[str, list[dict[str, Any]]]) -> CallRequest:
    """A `/v1/responses` body as a chat request (see the module docstring)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, _FIELDS, _NOOP, _INSTEAD)
    prev_id = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if prev_id is not None:
        if prev_id not in conversations:
            raise ApiError(400, f"Previous response with id {prev_id!r} not found: a trajectory continues only its "
                           "own responses", "previous_response_id", code="previous_response_not_found")
        history = conversations[prev_id]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"model": body.get("model"), "messages": [*system, *_wire(history),
                                                                     *_messages(body.get("input"))]}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("stream", "stream"),
                     ("stream_options", "stream_options")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise ApiError(400, "'text' must be {'format': {...}}", "text")
        if json_schema_of(text.get("format"), "text") is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": json_schema_of(text["format"])}}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    req = parse_chat(chat, agents)
    req.carry = (req.messages or [])[len(system):]
    return req


def _wire(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored (parsed) messages back in the chat wire form `parse_chat` reads."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{"id": c["id"], "type": "function", "function": {
                "name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def _items(req: CallRequest, answer: Answer, text_lp: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if answer.content or not answer.tool_calls:
        items.append({"type": "message", "id": f"msg_{req.id}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": answer.content or "", "annotations": [],
                                   "logprobs": text_lp or []}]})
    for c in answer.tool_calls:
        items.append({"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    return items


def response_body(req: CallRequest, prompt_len: int, gens: Sequence[Generation], decode: Any,
                  fingerprint: str, answers: Sequence[Answer]) -> dict[str, Any]:
    """The `response` object of a call (one choice: the Responses API has no `n`)."""
    g, answer = gens[0], answers[0]
    cut = g.finish_reason == "length" and not answer.tool_calls
    out = len(g.response_ids)
    choice = {"function": {"type": "function", "name": req.tool_function}}.get(req.tool_choice, req.tool_choice)
    return {
        "id": f"resp_{req.id}", "object": "response", "created_at": req.created, "model": req.agent,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "output": _items(req, answer, None),
        "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": choice,
        "tools": [{"type": "function", "strict": False, **t} for t in req.tools],
        "temperature": req.sampling.temperature, "top_p": req.sampling.top_p,
        "max_output_tokens": req.sampling.max_new_tokens,
        "text": {"format": {"type": "text"} if req.sampling.json_schema is None else {
            "type": "json_schema", "name": "output", "schema": req.sampling.json_schema, "strict": True}},
        "truncation": "disabled", "metadata": {}, "service_tier": "default",
        "usage": {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": out,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_len + out},
    }


def response_events(body: dict[str, Any], req: CallRequest, pieces: list[list[Piece]]) -> Iterator[str]:
    """The Responses stream: created, each output item (its text deltas or its arguments), completed."""
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

    yield event("response.created", response={**body, "status": "in_progress", "output": []})
    yield event("response.in_progress", response={**body, "status": "in_progress", "output": []})
    for k, item in enumerate(body["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=k,
                        item={**item, "status": "in_progress", "content": []})
            where = {"item_id": item["id"], "output_index": k, "content_index": 0}
            yield event("response.content_part.added", **where, part={**part, "text": ""})
            for text, _a, _b in pieces[0] if pieces else []:
                yield event("response.output_text.delta", **where, delta=text, logprobs=[])
            yield event("response.output_text.done", **where, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, part=part)
        else:
            yield event("response.output_item.added", output_index=k,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                        name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=k, item=item)
    yield event("response.completed", response=body)
