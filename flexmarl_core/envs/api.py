"""One small protocol for every environment an environment team plays, and the factory that
turns a spec string into one.

The team loop only ever asks whose turn it is, what that seat sees, and what an answer did:
OpenSpiel, TextArena, PettingZoo and a user's own class are all brought down to `Turn`, `Step`,
`Episode` and `Environment`, so the loop, the store and the rewards never learn which package
is underneath. The adapters are loaded by name (like a user's class) so that no optional package
is imported before a spec asks for it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from flexmarl_core.config import ConfigError


@dataclass(frozen=True)
class Turn:
    """Whose move it is and what that seat is prompted with."""

    seat: str
    observation: str
    legal: tuple[str, ...] = ()  # legal action texts where the env knows them; empty: free text


@dataclass(frozen=True)
class Step:
    """What one answer did. `valid=False`: not legal/parseable; the env's rule says who moves
    next (usually the same seat again). `rewards`: what this step handed out, per seat."""

    valid: bool
    rewards: Mapping[str, float] = field(default_factory=dict)
    note: str = ""


@runtime_checkable
class Episode(Protocol):
    seats: tuple[str, ...]

    def turn(self) -> Turn | None: ...  # None once the episode is over

    def act(self, text: str) -> Step: ...  # the seat's raw answer; the adapter parses it

    def returns(self) -> dict[str, float]: ...  # each seat's outcome (sum of its rewards)

    def close(self) -> None: ...


@runtime_checkable
class Environment(Protocol):
    seats: tuple[str, ...]

    def episode(self, seed: int) -> Episode: ...  # same seed + same answers -> same episode


# prefix -> (adapter module, the package to install, the flexmarl extra that installs it)
_ADAPTERS = {
    "openspiel": ("flexmarl_core.envs.openspiel", "open_spiel", "openspiel"),
    "textarena": ("flexmarl_core.envs.textarena", "textarena", "textarena"),
    "pettingzoo": ("flexmarl_core.envs.pettingzoo", "pettingzoo", "pettingzoo"),
}
_FORMS = ("openspiel:<game>, textarena:<env_id>, pettingzoo:<module>:<factory>, pettingzoo:<registry id> "
          "or python:<module>:<Class>")
_EPISODE_METHODS = ("turn", "act", "returns", "close")


def make_environment(spec: str, options: Mapping[str, Any] | None = None) -> Environment:
    """The environment `spec` names, set up with `options` (adapter settings and game
    parameters). Every problem with the spec is one `ConfigError` line naming it."""
    prefix, _, rest = spec.partition(":")
    opts = dict(options or {})
    if prefix == "python":
        return _user_environment(spec, rest, opts)
    if prefix not in _ADAPTERS or not rest:
        raise ConfigError(f"environment {spec!r}: unknown kind; use {_FORMS}")
    module = importlib.import_module(_ADAPTERS[prefix][0])
    return module.make(spec, rest, opts)


def require(spec: str, module: str) -> Any:
    """Import an optional package for `spec`'s adapter, or one line saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        _, package, extra = _ADAPTERS[spec.partition(":")[0]]
        raise ConfigError(
            f"environment {spec!r} needs {package}: pip install 'flexmarl[{extra}]' ({exc})"
        ) from None


def load_callable(where: str, ref: str, what: str) -> Callable[..., Any]:
    """`module:name` -> the object, or one line: `where` (e.g. "environment 'x:y'"), then what
    is wrong with the `what` that `ref` names."""
    mod_name, _, name = ref.partition(":")
    if not mod_name or not name:
        raise ConfigError(f"{where}: {what} {ref!r} must be 'module:name'")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{where}: {what} {ref!r}: no module {exc.name!r}") from None
    obj = getattr(module, name, None)
    if not callable(obj):
        raise ConfigError(f"{where}: {what} {ref!r}: module {mod_name!r} has no callable {name!r}")
    return obj


def parse_action(text: str, legal: tuple[str, ...]) -> str | None:
    """The one legal action `text` names, or None. A bracketed `[x]` naming a legal action wins
    (the last such one); otherwise exactly one legal action must appear as a whole word.
    Exact case is preferred; a case-insensitive match counts when it is unambiguous."""
    if not legal:
        return None

    def match(candidate: str) -> str | None:
        if candidate in legal:
            return candidate
        folded = [a for a in legal if a.lower() == candidate.lower()]
        return folded[0] if len(folded) == 1 else None

    for candidate in reversed(re.findall(r"\[([^\[\]\n]{1,200})\]", text)):
        hit = match(candidate.strip())
        if hit is not None:
            return hit
    hits = [a for a in legal if re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE)]
    return hits[0] if len(hits) == 1 else None


def bracketed(actions: tuple[str, ...]) -> str:
    return " ".join(f"[{a}]" for a in actions)


def _user_environment(spec: str, ref: str, options: dict[str, Any]) -> Environment:
    cls = load_callable(f"environment {spec!r}", ref, "class")
    try:
        env = cls(**options)
    except TypeError as exc:
        raise ConfigError(f"environment {spec!r}: cannot be built from options {sorted(options)}: {exc}") from None
    missing = [n for n in ("episode",) if not callable(getattr(env, n, None))]
    seats = getattr(env, "seats", None)
    if not isinstance(seats, tuple) or not seats or not all(isinstance(s, str) for s in seats):
        missing.append("seats (a non-empty tuple of str)")
    if missing:
        raise ConfigError(f"environment {spec!r} does not implement Environment: missing {', '.join(missing)}")
    return _CheckedEnvironment(spec, env)


class _CheckedEnvironment:
    """A user's environment whose episodes are checked for the protocol when they are made."""

    def __init__(self, spec: str, env: Any) -> None:
        self.spec, self.inner, self.seats = spec, env, tuple(env.seats)

    def episode(self, seed: int) -> Episode:
        ep = self.inner.episode(seed)
        missing = [n for n in _EPISODE_METHODS if not callable(getattr(ep, n, None))]
        missing += [] if isinstance(getattr(ep, "seats", None), tuple) else ["seats"]
        if missing:
            raise ConfigError(f"environment {self.spec!r}: its episode does not implement Episode: missing {', '.join(missing)}")
        return ep
