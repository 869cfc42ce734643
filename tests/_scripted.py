"""Scripted agents for endpoint tests: each call is answered with the text a rule gives for
its prompt, as token ids ending in EOS, so a test checks the mechanism, never what a model
happened to write."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation
from flexmarl_core.programs.api import DecodeGroup, DecodeStats
from flexmarl_core.programs.capture import trajectory_rows
from flexmarl_core.programs.chat import BUILTIN
from flexmarl_core.programs.gateway import AgentSpec, Session
from tests._models_util import tokenizer

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=48)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


class ScriptDispatcher:
    """Answers each call with `script(agent, prompt_text)`, as its token ids and EOS."""

    def __init__(self, script: Callable[[str, str], str]) -> None:
        self.script = script
        self.tok = tokenizer()
        self.lock = threading.Lock()

    def capacity(self, agent: str) -> int:
        return 64

    def decode(self, agent: str, version: int, groups: Sequence[DecodeGroup],
               stats: DecodeStats) -> list[list[Generation]]:
        out = []
        for g in groups:
            with self.lock:
                prompt = self.tok.decode(list(g.prompt_ids), skip_special_tokens=False)
                text = self.script(agent, prompt)
                ids = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
            out.append([Generation(prompt_ids=list(g.prompt_ids), response_ids=ids, text=text,
                                   logprobs=[-0.25] * len(ids), finish_reason="eos", version=version)] * g.n)
        return out


def scripted_session(dispatcher, agents=("planner", "solver"), template: str = "chatml") -> Session:
    specs = {a: AgentSpec(a, SAMPLING, BUILTIN[template], tokenizer(), 2048) for a in agents}
    return Session("tools", specs, dict.fromkeys(agents, 0), dispatcher, lambda i, t, a, c: hash(c) % 1000)


def capture_rows(res) -> dict[str, list[dict]]:
    tok = tokenizer()
    return trajectory_rows(res, lambda a, ids: tok.decode(ids, skip_special_tokens=False))
