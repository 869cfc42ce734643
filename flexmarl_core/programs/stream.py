"""`stream: true`: a response as OpenAI's server-sent events, made once the decode has ended.

The engines decode a batch of calls at once, so a call's tokens are known together; the events
are cut from the finished response, one content chunk per token (the text its tokens add, with
their log-probs when asked), then each tool call (its name, then its arguments), the finish
reason, and the usage chunk when `stream_options.include_usage` is set. Joined, the chunks are
exactly the non-streamed response, and the call is recorded the same: streaming changes the
wire, never the sample."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from flexmarl_core.programs.protocol import CallRequest

#: (text, first token, end token): a chunk of content and the tokens it comes from
Piece = tuple[str, int, int]


def split(content: str, ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[Piece]:
    """`content` cut at token boundaries: each token's added text while the decoded tokens spell
    `content`; whatever they do not (a stop string cut away, a forced prefix) is one last piece."""
    out: list[Piece] = []
    acc, prev, start = "", "", 0
    for k in range(1, len(ids) + 1):
        cur = decode(list(ids[:k]))
        if not cur.startswith(prev):
            break
        piece, prev = cur[len(prev):], cur
        if not piece:
            continue  # a token that adds no text yet (part of a multi-byte character): next one
        if not content.startswith(acc + piece):
            break
        out.append((piece, start, k))
        acc, start = acc + piece, k
    if acc != content:
        out.append((content[len(acc):], start, len(ids)))
    elif out and out[-1][2] < len(ids):  # tokens that add no text (EOS) go with the last piece
        out[-1] = (out[-1][0], out[-1][1], len(ids))
    return out


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def chat_events(body: dict[str, Any], req: CallRequest, pieces: list[list[Piece]]) -> Iterator[str]:
    """`chat.completion.chunk`s of a `chat.completion` body."""
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    usage = {"usage": None} if req.include_usage else {}

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> str:
        return _sse({**head, "object": "chat.completion.chunk", **usage,
                     "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

    for i, choice in enumerate(body["choices"]):
        msg, lps = choice["message"], (choice["logprobs"] or {}).get("content")
        yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
        for text, a, b in pieces[i]:
            yield chunk(i, {"content": text}, lp={"content": lps[a:b], "refusal": None} if lps is not None else None)
        for j, call in enumerate(msg.get("tool_calls") or []):
            fn = call["function"]
            yield chunk(i, {"tool_calls": [{"index": j, "id": call["id"], "type": "function",
                                            "function": {"name": fn["name"], "arguments": ""}}]})
            yield chunk(i, {"tool_calls": [{"index": j, "function": {"arguments": fn["arguments"]}}]})
        yield chunk(i, {}, choice["finish_reason"])
    if req.include_usage:
        yield _sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": body["usage"]})
    yield _sse("[DONE]")


def completion_events(body: dict[str, Any], req: CallRequest, pieces: list[list[Piece]]) -> Iterator[str]:
    """`text_completion` chunks of a completion body."""
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    usage = {"usage": None} if req.include_usage else {}
    for i, choice in enumerate(body["choices"]):
        lp = choice["logprobs"]
        for text, a, b in pieces[i]:
            part = None if lp is None else {
                "tokens": lp["tokens"][a:b], "token_logprobs": lp["token_logprobs"][a:b],
                "top_logprobs": lp["top_logprobs"][a:b], "text_offset": lp["text_offset"][a:b]}
            yield _sse({**head, "object": "text_completion", **usage,
                        "choices": [{"index": i, "text": text, "logprobs": part, "finish_reason": None}]})
        yield _sse({**head, "object": "text_completion", **usage,
                    "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}]})
    if req.include_usage:
        yield _sse({**head, "object": "text_completion", "choices": [], "usage": body["usage"]})
    yield _sse("[DONE]")
