"""Chat templates: an OpenAI `messages` list -> the prompt text an agent's model sees.

An agent's `chat_template` (config) is one of:

- `plain`: the messages' contents concatenated in order, nothing added. A program that sends
  one user message `"Q:3+4\\nP:"` gives the model exactly that text, as the YAML team's
  template `"Q:{input}\\nP:"` does, so a program team and a YAML team can share an SFT start.
- `chatml`: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`
  (Qwen2's format; the local tokenizer's own template, whose EOS is `<|im_end|>`).
- `tokenizer`: the tokenizer's own `chat_template` (a model loaded from a local folder).

A YAML team's agent uses the same templates (`as_turns`): its `system` message and its rendered
`template` as the user message, so its prompt is what the endpoint renders for those messages.
- any other string: a Jinja template, rendered like transformers' `apply_chat_template`
  (variables `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`).

Tools (a request's `tools`) go to every template as transformers passes them (`tools`: a list
of `{"type": "function", "function": {...}}`; an assistant message's `tool_calls` as
`{"id", "type", "function": {"name", "arguments"}}`), so a real model's own template renders
them its own way. The built-in templates write them in the agent's tool-call format (its
`tool_parser`), Qwen2.5's layout:

- `chatml`: a system turn listing the tools (after the request's own system message, if
  any) and how to call one; an assistant's calls after its content, one per line; the results
  of consecutive `tool` messages in one user turn, each `<tool_response>\\n...\\n</tool_response>`.
- `plain`: the same, without turn markers: `Tools:` and the tools, one JSON object a line,
  then the messages' contents, calls and `<tool_response>...</tool_response>` in order.

Without tools, tool calls or tool messages, both render exactly as before.

Rendering runs in Jinja's immutable sandbox: a template is configuration, never code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flexmarl_core.models.tokenizer import CHAT_TEMPLATE
from flexmarl_core.programs.tools import TOOL_PARSERS, ToolCall, ToolParser

if TYPE_CHECKING:
    from flexmarl_core.config import AgentConfig

PLAIN = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
#: `plain` with tools (without them it renders as `PLAIN`)
PLAIN_TOOLS = (
    "{%- if tools %}{{ 'Tools:\\n' }}{% for tool in tools %}{{ tool['function'] | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ call_help + '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{{ '<tool_response>' + message['content'] + '</tool_response>' }}"
    "{%- else %}{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}{{ render_call(call) }}{% endfor %}{% endif %}"
    "{%- endfor %}"
)
#: `chatml` with tools (without them it renders as the tokenizer's `CHAT_TEMPLATE`)
CHATML_TOOLS = (
    "{%- set rest = messages %}"
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] in ('system', 'developer') %}{{ messages[0]['content'] + '\\n\\n' }}"
    "{%- set rest = messages[1:] %}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool['function'] | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools>\\n\\n' + call_help + '<|im_end|>\\n' }}{% endif %}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{ ('\\n' if message['content'] or not loop.first else '') + render_call(call) }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILTIN: dict[str, str] = {"plain": PLAIN, "chatml": CHAT_TEMPLATE}
#: a built-in template's tool-aware form, used once a request carries tools or tool messages
WITH_TOOLS: dict[str, str] = {PLAIN: PLAIN_TOOLS, CHAT_TEMPLATE: CHATML_TOOLS}
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A template that does not compile or render; the message names the agent."""


def _tojson(value: Any, indent: int | None = None) -> str:
    """transformers' `tojson`: plain JSON, no HTML escaping (Jinja's own escapes `<` and `>`)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=64)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def template_source(name_or_source: str, tokenizer: Any = None) -> str:
    """The Jinja source a config value names (see the module docstring)."""
    if name_or_source in BUILTIN:
        return BUILTIN[name_or_source]
    if name_or_source == "tokenizer":
        own = getattr(tokenizer, "chat_template", None)
        if not isinstance(own, str) or not own:
            raise ChatTemplateError("chat_template 'tokenizer': this model's tokenizer has no chat_template; "
                                    f"use one of {sorted(BUILTIN)} or a Jinja template")
        return own
    return name_or_source


def render(source: str, messages: Sequence[dict[str, Any]], tokenizer: Any = None, *,
           tools: Sequence[dict[str, Any]] = (), parser: ToolParser | None = None) -> str:
    """The prompt text of `messages` (already validated: role and string content each, an
    assistant's `tool_calls` as `{"id", "name", "arguments"}`) with `tools` (`{"name",
    "description", "parameters"}` each); `parser` writes calls for the built-in templates."""
    wants_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if wants_tools:
        source = WITH_TOOLS.get(source, source)
    msgs = [{**m, "tool_calls": [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    writes = parser or TOOL_PARSERS.get("hermes")
    extra: dict[str, Any] = {}
    if wants_tools:
        extra = {"tools": [{"type": "function", "function": t} for t in tools] or None,
                 "render_call": lambda c: writes.render(ToolCall(c["function"]["name"], c["function"]["arguments"])),
                 "call_help": "To call a function, answer with " + writes.render(
                     ToolCall("<function-name>", {"<argument>": "<value>"}))}
    try:
        return _compile(source).render(
            messages=msgs, add_generation_prompt=True,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "", **extra)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None


def as_turns(agent: AgentConfig, text: str) -> str:
    """A YAML agent's prompt in its chat format: its `system` message, then `text` (its rendered
    template) as the user message, through its `chat_template` with its model's tokenizer: the
    very text the program endpoint renders for those two messages."""
    folder = agent.model.folder()
    tok = _tokenizer(None if folder is None else str(folder))
    messages = [{"role": "system", "content": agent.system}] if agent.system is not None else []
    try:
        return render(template_source(agent.chat_template, tok), [*messages, {"role": "user", "content": text}], tok)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"agent {agent.name!r}: {e}") from None


@lru_cache(maxsize=16)
def _tokenizer(folder: str | None) -> Any:
    from flexmarl_core.models import get_tokenizer, load_tokenizer

    return get_tokenizer() if folder is None else load_tokenizer(folder)
