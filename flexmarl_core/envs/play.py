"""Episodes of an environment team, played together: the environment says whose turn it is and
what that seat sees; a scripted seat answers at once, an agent's seats are answered in one
batch per agent per round (episodes run in parallel, the turns of one episode never do).

What an answer earns: the rewards the environment hands its seat until the seat answers again
(per-turn rewards, and the outcome at the end), plus `invalid_penalty` if the environment
refused it. Each answer is credited with its return, G = r + gamma * G_next over the seat's own
answers. A seat refused `max_invalid` times in a row on one turn forfeits: the episode ends.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexmarl_core.config.environment import EnvironmentConfig
from flexmarl_core.envs.api import Environment, Episode, Turn
from flexmarl_core.envs.scripted import scripted_policy


@dataclass
class Answer:
    """One seat's answer on one turn: what it saw (`messages`: its conversation, the last one
    the observation) and said; `reply` is the agent's decode (None: a scripted seat)."""

    seat: str
    agent: str
    k: int  #: this answer's index among the agent's answers in the episode (its past selves' apart)
    messages: list[dict[str, str]]
    text: str = ""
    valid: bool = True
    reward: float = 0.0  #: what it earned before the seat's next answer (see the module doc)
    ret: float = 0.0  #: its discounted return
    reply: Any = None
    #: the agent's prompt for `messages` as it was decoded (token ids, text)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""


@dataclass
class Played:
    """One episode: its identity, every answer in order, each seat's outcome."""

    input_id: str
    traj: int
    mb: int
    seed: int
    answers: list[Answer] = field(default_factory=list)
    returns: dict[str, float] = field(default_factory=dict)
    forfeit: str | None = None  #: the seat that gave up after too many refused answers
    truncated: bool = False  #: stopped at `max_turns`


@dataclass
class Pending:
    """An agent's seat waiting for its answer: the reply function fills `answer.text` and
    `answer.reply`."""

    played: Played
    answer: Answer


#: answers the agents' pending seats in place, all of one round together
Reply = Callable[[list[Pending]], None]


def episode_seed(input_id: str) -> int:
    """The chance outcomes of an input's episodes: one seed per input, so its group's
    trajectories play the same deal and differ only by what the seats answer."""
    return zlib.crc32(input_id.encode())


def play(env: Environment, ecfg: EnvironmentConfig, seats: Mapping[str, str | None],
         jobs: Sequence[tuple[str, int, int]], reply: Reply) -> list[Played]:
    """Play one episode per job (input_id, traj, mb), returned in job order. `seats`: seat ->
    the agent that plays it, or None: scripted (`ecfg.seats`, or `ecfg.eval_opponent` where the
    seat's config names an agent: the evaluation replaces seats this way)."""
    out: list[Played] = []
    live: list[tuple[Played, Episode, _Seats]] = []
    for input_id, traj, mb in jobs:
        seed = episode_seed(input_id)
        p = Played(input_id, traj, mb, seed)
        out.append(p)
        live.append((p, env.episode(seed), _Seats(ecfg, seats, f"{seed}:{traj}")))
    while live:
        round_: list[tuple[Played, Episode, _Seats, Turn, Answer]] = []
        for p, ep, st in live:
            turn = ep.turn()
            if turn is not None:
                round_.append((p, ep, st, turn, st.ask(turn)))
        pending = [Pending(p, a) for p, _, st, _, a in round_ if st.plays(a.seat)]
        if pending:
            reply(pending)
        for p, ep, st, turn, a in round_:
            if not st.plays(a.seat):
                a.text = st.script(turn)
            step = ep.act(a.text)
            a.valid = step.valid
            p.answers.append(a)
            if st.answered(a, step.note) >= ecfg.max_invalid:
                p.forfeit = a.seat
            if not step.valid:
                a.reward += ecfg.invalid_penalty
            for seat, r in step.rewards.items():  # this answer's own rewards are its own
                st.earn(seat, r)
        still = []
        for p, ep, st in live:
            over = ep.turn() is None
            if p.forfeit is None and not over and len(p.answers) < ecfg.max_turns:
                still.append((p, ep, st))
                continue
            p.truncated = p.forfeit is None and not over
            p.returns = {s: 0.0 for s in ep.seats} if p.forfeit else {s: float(v) for s, v in ep.returns().items()}
            if p.forfeit:
                p.returns[p.forfeit] = ecfg.invalid_penalty
            ep.close()
            _credit(p, ecfg.gamma)
        live = still
    return out


def _credit(p: Played, gamma: float) -> None:
    """Each answer's return over its seat's later answers."""
    nxt: dict[str, float] = {}
    for a in reversed(p.answers):
        a.ret = a.reward + gamma * nxt.get(a.seat, 0.0)
        nxt[a.seat] = a.ret


class _Seats:
    """Who plays each seat of one episode, each seat's conversation so far, and its refused
    answers in a row."""

    def __init__(self, ecfg: EnvironmentConfig, seats: Mapping[str, str | None], key: str) -> None:
        self.ecfg, self.seats, self.key = ecfg, seats, key
        self.history: dict[str, list[dict[str, str]]] = {}
        self.refused: dict[str, int] = {}
        self.calls: dict[str, int] = {}  #: answers per agent so far
        self.last: dict[str, Answer] = {}  #: each seat's latest answer
        self.early: dict[str, float] = {}  #: rewards a seat got before its first answer
        self.note: dict[str, str] = {}  #: why the seat's last answer was refused
        self._scripts: dict[str, Callable[[Turn, random.Random], str]] = {}
        self._rngs: dict[str, random.Random] = {}

    def plays(self, seat: str) -> bool:
        """Whether an agent plays `seat` (else a script)."""
        return self.seats.get(seat) is not None

    def ask(self, turn: Turn) -> Answer:
        seat = turn.seat
        if seat not in self.seats:
            raise ValueError(f"the environment gave the turn to seat {seat!r}, which team.environment.seats "
                             f"does not name (seats: {sorted(self.seats)})")
        seen = turn.observation if seat not in self.note else f"{self.note.pop(seat)}\n{turn.observation}"
        convo = [*self.history.get(seat, [])] if self.ecfg.samples == "multi_turn" else []
        convo.append({"role": "user", "content": seen})
        agent = self.seats[seat] or ""
        key = agent if self.ecfg.seats[seat].learns else f"{agent}/past"
        k = self.calls.get(key, 0)
        self.calls[key] = k + 1
        return Answer(seat, agent, k, convo)

    def script(self, turn: Turn) -> str:
        seat = turn.seat
        if seat not in self._scripts:
            cfg = self.ecfg.seats[seat]
            self._scripts[seat] = scripted_policy(cfg.scripted or self.ecfg.eval_opponent)
            self._rngs[seat] = random.Random(f"{self.key}:{seat}")
        return self._scripts[seat](turn, self._rngs[seat])

    def answered(self, a: Answer, note: str) -> int:
        """Note the answer; the seat's refused answers in a row on this turn."""
        self.history[a.seat] = [*a.messages, {"role": "assistant", "content": a.text}]
        if a.seat not in self.last:
            a.reward += self.early.pop(a.seat, 0.0)
        self.last[a.seat] = a
        if a.valid:
            self.refused[a.seat] = 0
            return 0
        self.note[a.seat] = f"Your answer was refused: {note or 'not a legal move'}"
        self.refused[a.seat] = self.refused.get(a.seat, 0) + 1
        return self.refused[a.seat]

    def earn(self, seat: str, r: float) -> None:
        if seat in self.last:
            self.last[seat].reward += r
        else:
            self.early[seat] = self.early.get(seat, 0.0) + r


def seat_agents(ecfg: EnvironmentConfig) -> dict[str, str | None]:
    """seat -> the agent that plays it in training (None: scripted)."""
    return {s: c.agent for s, c in ecfg.seats.items()}


def against(ecfg: EnvironmentConfig, seat: str) -> dict[str, str | None]:
    """The evaluation's seats: `seat` played by its agent, every other one by the scripted
    `eval_opponent`."""
    return {s: (c.agent if s == seat else None) for s, c in ecfg.seats.items()}
