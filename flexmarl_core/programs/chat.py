"""Chat templates: an OpenAI `messages` list -> the prompt text an agent's model sees.

An agent's `chat_template` (config) is one of:

- `plain`: the messages' contents concatenated in order, nothing added. A program that sends
  one user message `"Q:3+4\\nP:"` gives the model exactly that text, as the YAML team's
  template `"Q:{input}\\nP:"` does, so a program team and a YAML team can share an SFT start.
- `chatml`: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`
  (Qwen2's format; the local tokenizer's own template, whose EOS is `<|im_end|>`).
- `tokenizer`: the tokenizer's own `chat_template` (a model loaded from a local folder).
- any other string: a Jinja template, rendered like transformers' `apply_chat_template`
  (variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`).

Rendering runs in Jinja's immutable sandbox: a template is configuration, never code.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flexmarl_core.models.tokenizer import CHAT_TEMPLATE

PLAIN = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
BUILTIN: dict[str, str] = {"plain": PLAIN, "chatml": CHAT_TEMPLATE}
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A template that does not compile or render; the message names the agent."""


@lru_cache(maxsize=64)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
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


def render(source: str, messages: Sequence[dict[str, str]], tokenizer: Any = None) -> str:
    """The prompt text of `messages` (already validated: role and string content each)."""
    try:
        return _compile(source).render(
            messages=list(messages), add_generation_prompt=True,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "")
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None
