"""What the endpoint knows of the program it serves: each agent's spec, each program op's
session, and each trajectory of it (its key, its calls, what its later calls refer back to)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flexmarl_core.config import SamplingConfig
from flexmarl_core.programs.api import CallRecord, DecodeStats, Dispatcher
from flexmarl_core.programs.tools import TOOL_PARSERS, ToolParser


@dataclass
class AgentSpec:
    """What the endpoint needs of one agent: sampling defaults, chat template (Jinja source),
    tokenizer (the endpoint's own copy) and the model's context length."""

    name: str
    sampling: SamplingConfig
    template: str
    tokenizer: Any
    max_context: int
    parser: ToolParser = field(default_factory=lambda: TOOL_PARSERS.get("hermes"))
    #: the longest text (UTF-8 bytes) one token stands for: a text of more bytes than this times
    #: the context is too long, known without tokenising it
    max_token_bytes: int = 0

    def __post_init__(self) -> None:
        # Rust tokenizers refuse concurrent use from two threads: the endpoint's thread
        # tokenizes while an engine in this process decodes with its own.
        self.tokenizer = copy.deepcopy(self.tokenizer)
        if not self.max_token_bytes:
            vocab = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self.max_token_bytes = max((len(str(v).encode()) for v in vocab if v is not None), default=1) or 1
        # one template render and tokenisation at a time per agent (the tokenizer's own rule)
        self.lock = threading.Lock()


@dataclass
class Trajectory:
    """One run of the program: its calls, in the order they were answered."""

    session: Session
    input_id: str
    traj: int
    mb: int
    token: str
    records: list[CallRecord] = field(default_factory=list)
    #: (agent, prompt digest) -> calls of it so far: a call's occurrence among identical prompts
    seen: dict[tuple[str, str], int] = field(default_factory=dict)
    #: tool call id -> the exact text of the answer that made it (what a later call sends back)
    answers: dict[str, str] = field(default_factory=dict)
    #: Responses API: response id -> the conversation through it (what `previous_response_id`
    #: continues; a trajectory's own responses only)
    conversations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: calls that came through a client flexmarl did not make (a program's own, or a shared one)
    foreign: int = 0
    #: calls made through another trajectory's client and attributed to this one by context
    rerouted: int = 0
    pending: int = 0
    live: bool = True
    #: the agent whose last answer here was a tool call that does not parse or names a function
    #: it was not offered (None once an answer is well formed): ending on it is the model's failure
    broken_call: str | None = None

    @property
    def key(self) -> str:
        """The API key this trajectory's calls carry: its op's key and its own token."""
        return f"{self.session.key}.{self.token}"


class Session:
    """The trajectories of one program op (or one evaluation): their agents, the weights
    version of each, who decodes, how seeds are derived, and what was measured."""

    def __init__(self, key: str, agents: dict[str, AgentSpec], versions: dict[str, int], dispatcher: Dispatcher,
                 seed_of: Callable[[str, int, str, str], int], *, window_s: float = 0.02, greedy: bool = False,
                 fingerprint: str = "flexmarl") -> None:
        self.key, self.agents, self.versions, self.dispatcher = key, agents, versions, dispatcher
        self.seed_of, self.window_s, self.greedy, self.fingerprint = seed_of, window_s, greedy, fingerprint
        self.defaults = {a: s.sampling for a, s in agents.items()}
        self.trajectories: dict[str, Trajectory] = {}
        #: the first machinery failure (a decode that could not run)
        self.error: BaseException | None = None
        #: per decode: (agent, requests, rows, what the dispatcher measured)
        self.decodes: list[tuple[str, int, int, DecodeStats]] = []
        #: per answered request: seconds in the endpoint beyond waiting for and running its decode
        self.overheads: list[float] = []
