"""Tool calls inside a response: generate up to a call, run the tool, insert its output, go on.

A `Tool` is deterministic and shipped with the workload (`workload.tool(agent)`). A call is the
text between the tool's `open` marker and its `close` marker; `close` is an extra stop string
while generating. When a row stops on it, the tool's output text is tokenized and appended to
that row's response, and the row continues from the longer context, up to `max_calls` calls.

    [47*23]=1081;1081+19
    ^^^^^^^ sampled (mask 1)  ^^^^^ inserted (mask 0)  ^^^^^^^^^ sampled (mask 1)

`Generation.loss_mask` marks each response token: 1 = sampled by the policy (it has a behaviour
logprob), 0 = inserted by the tool (its logprob slot holds 0.0 and the loss never sees it). The
trainer recomputes logprobs over the whole sequence (inserted tokens are context for what follows),
and the mask keeps them out of the loss. `max_new_tokens` bounds the whole response, inserted
tokens included, so a sequence never outgrows the config's context.

SFT sees demonstrations the same way (`split_demonstration`): the workload's demonstration text
holds the tool's outputs, and each is tokenized on its own, masked, exactly as a rollout inserts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flexmarl_core.inference.api import Generation
from flexmarl_core.inference.hf import encode_prompts, first_stop

if TYPE_CHECKING:
    from flexmarl_core.config import SamplingConfig


@runtime_checkable
class Tool(Protocol):
    """A deterministic tool: call text in, output text out."""

    open: str  #: marks the start of a call in the response
    close: str  #: ends a call; generation stops there and the tool runs
    max_calls: int  #: calls per response; after that `close` is plain text

    def __call__(self, call: str) -> str:
        """The output inserted after the close marker (never empty, never raises)."""
        ...


def _call_text(text: str, tool: Tool) -> str:
    """The call that `text` (ending with the close marker) makes: after the last open marker."""
    end = text.rfind(tool.close)
    start = text.rfind(tool.open, 0, end)
    return text[start + len(tool.open) : end] if start >= 0 else text[:end]


def generate_with_tool(
    engine: Any,
    prompts: Sequence[str],
    sampling: SamplingConfig,
    seed: int,
    tool: Tool | None,
) -> list[Generation]:
    """`engine.generate`, with `tool`'s calls run and their outputs inserted (masked).

    Without a tool this is exactly `engine.generate(prompts, sampling, seed)`. With one, each
    segment is a fresh `generate` over prompt + response so far (token ids, so nothing is
    re-tokenized) for the rows still running, seeded by `(seed, segment)`: the same inputs give
    the same samples in every schedule. The engine must take token-id prompts and expose its
    `tokenizer` and `eos_ids` (the HF engine; a vLLM agent with a tool is refused at config load).
    """
    if tool is None:
        return engine.generate(prompts, sampling, seed=seed)
    if not (hasattr(engine, "tokenizer") and hasattr(engine, "eos_ids")):
        raise TypeError(f"{type(engine).__name__} cannot run a tool loop: it needs an engine that "
                        "continues from token ids and exposes `tokenizer` and `eos_ids` (the hf engine)")
    if tool.close in sampling.stop:
        raise ValueError(f"the tool's close marker {tool.close!r} is also a stop string {sampling.stop}")
    tok = engine.tokenizer
    prompt_ids = encode_prompts(tok, prompts)
    n = len(prompt_ids)
    resp: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    mask: list[list[int]] = [[] for _ in range(n)]
    calls = [0] * n
    final: list[Generation | None] = [None] * n
    active = list(range(n))
    segment = 0
    while active:
        # Rows that may still call stop on the close marker too; the segment's budget is what the
        # longest of them has left (a row is cut to its own budget below).
        seg_sampling = sampling.model_copy(update={
            "stop": [*sampling.stop, tool.close],
            "max_new_tokens": max(sampling.max_new_tokens - len(resp[i]) for i in active),
        })
        gens = engine.generate([prompt_ids[i] + resp[i] for i in active], seg_sampling,
                               seed=(int(seed) * 1_000_003 + segment) % 2**63)
        segment += 1
        still = []
        for i, g in zip(active, gens, strict=True):
            room = sampling.max_new_tokens - len(resp[i])
            ids = g.response_ids[:room]
            resp[i] += ids
            lps[i] += g.logprobs[:room]
            mask[i] += [1] * len(ids)
            seg_text = tok.decode(ids, skip_special_tokens=False)
            own, at = first_stop(seg_text, sampling.stop), seg_text.find(tool.close)
            on_close = (g.finish_reason == "stop" and len(ids) == len(g.response_ids)
                        and at >= 0 and (own is None or at < own))
            if on_close and calls[i] < tool.max_calls:
                text = tok.decode(resp[i], skip_special_tokens=False)
                out_ids = tok.encode(tool(_call_text(text, tool)), add_special_tokens=False)
                out_ids = out_ids[: sampling.max_new_tokens - len(resp[i])]
                resp[i] += out_ids
                lps[i] += [0.0] * len(out_ids)
                mask[i] += [0] * len(out_ids)
                calls[i] += 1
            # Past its calls, a close marker is plain text: the row just goes on.
            if on_close and len(resp[i]) < sampling.max_new_tokens:
                still.append(i)
                continue
            final[i] = _finish(tok, engine, prompt_ids[i], resp[i], lps[i], mask[i], sampling, g.version)
        active = still
    return [g for g in final if g is not None]


def _finish(tok: Any, engine: Any, prompt: list[int], resp: list[int], lps: list[float],
            mask: list[int], sampling: SamplingConfig, version: int) -> Generation:
    """The whole response under `inference/api.py`'s rules: text cut before the first stop
    string, a final EOS kept in the ids and left out of the text."""
    eos = set(engine.eos_ids)
    reason = "length"
    body = resp
    if resp and resp[-1] in eos and mask[-1] == 1:
        reason, body = "eos", resp[:-1]
    text = tok.decode(body, skip_special_tokens=False)
    cut = first_stop(text, sampling.stop)
    if cut is not None:
        reason, text = "stop", text[:cut]
    return Generation(prompt_ids=prompt, response_ids=resp, text=text, logprobs=lps,
                      finish_reason=reason, version=version,  # type: ignore[arg-type]
                      loss_mask=None if all(mask) else mask)


def split_demonstration(text: str, tool: Tool | None) -> list[tuple[str, bool]]:
    """A demonstration's text as (segment, sampled) pieces: after each of the first `max_calls`
    close markers the tool's own output for that call is an inserted (unsampled) piece. A
    demonstration that does not carry the tool's output there is an error (SFT would teach the
    model to write what the tool writes)."""
    if tool is None:
        return [(text, True)]
    pieces: list[tuple[str, bool]] = []
    done, pos = "", 0
    for _ in range(tool.max_calls):
        end = text.find(tool.close, pos)
        if end < 0:
            break
        end += len(tool.close)
        done += text[pos:end]
        pieces.append((text[pos:end], True))
        out = tool(_call_text(done, tool))
        if not text.startswith(out, end):
            raise ValueError(
                f"demonstration {text!r}: after the call {done!r} it must continue with the "
                f"tool's output {out!r}"
            )
        pieces.append((out, False))
        done += out
        pos = end + len(out)
    if pos < len(text):
        pieces.append((text[pos:], True))
    return pieces


def tool_of(workload: Any, agent: str) -> Tool | None:
    """The tool `workload` gives `agent` (workloads without tools have no `tool` method)."""
    get = getattr(workload, "tool", None)
    return get(agent) if get is not None else None
