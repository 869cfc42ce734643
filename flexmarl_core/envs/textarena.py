"""TextArena games as environments: `textarena:<env_id>` (e.g. `KuhnPoker-v0`, `TicTacToe-v0`).

TextArena games are already text in and text out: the answer goes to `env.step(action=text)`
unparsed and the game's own rules judge it. An invalid move makes the same player move again
(the game adds a GAME_ADMIN "attempted an invalid move" message and does not advance its turn
counter); a second one in a row ends the game as a loss for that player. Both come back as
`Step(valid=False)` with the game's reason as the note. Rewards only exist at the end: `close()`
returns `(rewards, game_info)` with `rewards` by player id, handed out on the final step.

TextArena draws its randomness from the global `random` module (`State` seeds it at reset and
games shuffle with it later), so each episode keeps its own copy of that state and swaps it in
around every call: the same seed gives the same episode however episodes interleave.
Options: `num_players` (default 2); the rest go to `ta.make(env_id, **options)`.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flexmarl_core.config import ConfigError
from flexmarl_core.envs.api import Step, Turn, require

_RANDOM = threading.Lock()  # the global random state is swapped per episode, one at a time


def make(spec: str, env_id: str, options: dict[str, Any]) -> TextArenaEnvironment:
    ta = require(spec, "textarena")
    num_players = int(options.pop("num_players", 2))
    if env_id not in ta.envs.registration.ENV_REGISTRY:
        raise ConfigError(f"environment {spec!r}: TextArena has no env {env_id!r}")

    def build() -> Any:
        return ta.make(env_id, **options)

    try:
        build()
    except TypeError as exc:
        raise ConfigError(f"environment {spec!r}: bad options {sorted(options)}: {exc}") from None
    return TextArenaEnvironment(build, num_players)


class TextArenaEnvironment:
    def __init__(self, build: Callable[[], Any], num_players: int) -> None:
        self._build = build
        self.seats = tuple(f"player_{i}" for i in range(num_players))

    def episode(self, seed: int) -> TextArenaEpisode:
        return TextArenaEpisode(self._build(), self.seats, seed)


def render(observation: Any) -> str:
    """TextArena's observation as one string: wrapped envs give a string already; raw ones a
    list of (sender id, message, type), rendered one message a line."""
    if isinstance(observation, str):
        return observation.strip("\n")
    lines = []
    for sender, message, *_ in observation:
        lines.append(f"[{'GAME' if sender == -1 else f'Player {sender}'}] {message}")
    return "\n".join(lines)


class TextArenaEpisode:
    def __init__(self, env: Any, seats: tuple[str, ...], seed: int) -> None:
        self.seats, self._env = seats, env
        self._random: Any = None
        self._turn: Turn | None = None
        self._done = self._closed = False
        self._returns = dict.fromkeys(seats, 0.0)
        with self._own_random(seed):
            env.reset(num_players=len(seats), seed=seed)

    @contextmanager
    def _own_random(self, seed: int | None = None) -> Iterator[None]:
        with _RANDOM:
            outer = random.getstate()
            if seed is not None:
                random.seed(seed)
            else:
                random.setstate(self._random)
            try:
                yield
            finally:
                self._random = random.getstate()
                random.setstate(outer)

    def turn(self) -> Turn | None:
        if self._done:
            return None
        if self._turn is None:  # get_observation() hands each message out once: ask once a turn
            with self._own_random():
                pid, observation = self._env.get_observation()
            self._turn = Turn(self.seats[pid], render(observation))
        return self._turn

    def act(self, text: str) -> Step:
        if self._done:
            raise RuntimeError("the episode is over")
        state = self._env.state
        pid, turn_before = state.current_player_id, state.turn
        with self._own_random():
            done, _info = self._env.step(action=text)
        self._turn = None
        if not done:
            if state.turn != turn_before:
                return Step(True)
            return Step(False, note=self._admin_note(pid))
        self._done = True
        with self._own_random():
            rewards, game_info = self._env.close()
        self._closed = True
        self._returns.update({self.seats[p]: float(r) for p, r in (rewards or {}).items()})
        handed = {s: r for s, r in self._returns.items() if r}
        info = game_info.get(pid, {}) if isinstance(game_info, dict) else {}
        if info.get("invalid_move"):
            return Step(False, handed, note=str(info.get("reason", "invalid move")))
        return Step(True, handed)

    def _admin_note(self, pid: int) -> str:
        """The game's latest admin message to `pid` (its reason for rejecting the move)."""
        pending = self._env.state.observations.get(pid, [])
        admin = [m for _, m, kind, *_ in pending if getattr(kind, "name", "") == "GAME_ADMIN"]
        return admin[-1] if admin else "invalid move"

    def returns(self) -> dict[str, float]:
        return dict(self._returns)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._own_random():
                self._env.close()
