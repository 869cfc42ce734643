"""Tool calls in a model's own words: a parser per model family, chosen per agent
(`tool_parser` in the agent's config), registered by name.

A parser reads what the agent sampled and returns the text outside the calls and the calls
(`extract`); it never raises: a malformed call stays plain text, as the model wrote it. It also
says how a call starts (`forced_prefix`), which the endpoint puts at the start of the answer when
`tool_choice` requires a call, and how a call is written (`render`), for the chat templates.
Parsing never changes what is trained: the call's record keeps the sampled token ids.

    @register_tool_parser("myfamily")
    class MyFamily(ToolParser): ...
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from flexmarl_core.algorithms.registry import Registry


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: a function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


class ToolParser:
    """One model family's tool-call format (see the module docstring)."""

    name = ""

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside the calls, the calls); no call parsed: (text, [])."""
        raise NotImplementedError

    def forced_prefix(self, function: str | None) -> str:
        """The start of an answer that is a call (of `function`, when one is named)."""
        raise NotImplementedError

    def attempted(self, text: str) -> bool:
        """Whether `text` starts a call in this format (parsed or not): a call that then does not
        parse is the model's broken call, not plain text it meant to say."""
        return False

    def render(self, call: ToolCall) -> str:
        """A call as the model writes it."""
        raise NotImplementedError


TOOL_PARSERS: Registry[Any] = Registry("tool parser", "team.agents.<agent>.tool_parser")


def register_tool_parser(name: str) -> Any:
    """Class decorator: one instance of the class serves every agent that names it."""
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        inst = cls()
        inst.name = name
        TOOL_PARSERS.register(name)(inst)
        return cls
    return deco


def _call(obj: Any) -> ToolCall | None:
    """A call from a parsed JSON object `{"name": ..., "arguments": {...}}` (`parameters` too)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


@register_tool_parser("hermes")
class Hermes(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call (Hermes, Qwen2.5,
    Qwen3 and the built-in chat template's tool format)."""

    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for m in self.BLOCK.finditer(text):
            try:
                call = _call(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                return text, []  # one malformed call: the answer is text, as written
            calls.append(call)
        if not calls:
            return text, []
        return self.BLOCK.sub("", text).strip(), calls

    def attempted(self, text: str) -> bool:
        return "<tool_call>" in text

    def forced_prefix(self, function: str | None) -> str:
        return '<tool_call>\n{"name": ' + (f'"{function}", "arguments": ' if function else "")

    def render(self, call: ToolCall) -> str:
        return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) + "\n</tool_call>"


@register_tool_parser("mistral")
class Mistral(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: every call of the answer in one
    JSON list after the marker (Mistral's instruct models)."""

    MARK = "[TOOL_CALLS]"

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.MARK)
        if at < 0:
            return text, []
        try:
            items, _ = json.JSONDecoder().raw_decode(text[at + len(self.MARK):].lstrip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(x) for x in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].strip(), [c for c in calls if c is not None]

    def attempted(self, text: str) -> bool:
        return self.MARK in text

    def forced_prefix(self, function: str | None) -> str:
        return self.MARK + '[{"name": ' + (f'"{function}", "arguments": ' if function else "")

    def render(self, call: ToolCall) -> str:
        return self.MARK + json.dumps([{"name": call.name, "arguments": call.arguments}])
