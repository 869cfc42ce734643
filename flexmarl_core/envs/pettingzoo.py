"""PettingZoo AEC environments as environments: `pettingzoo:<module>:<factory>`
(e.g. `pettingzoo:pettingzoo.classic.tictactoe_v3:env`) or a registry id (`pettingzoo:classic/
tictactoe-v3`, PettingZoo 1.27's `make("aec", id)`, which the module paths now warn is the way).

PettingZoo is the common interface of many multi-agent RL environments; its AEC API is already
one agent at a time. Each episode builds `factory(**options)` and `reset(seed=seed)`s it; the
agent to move is `agent_selection` while `agents` is non-empty (what `agent_iter()` yields), and
an agent that is terminated or truncated is stepped with `None`, as the API requires, before the
next live one is shown. Seats are the env's own agent names (`possible_agents`).

Actions are discrete indices: the legal ones are the observation's (or info's) `action_mask`,
else the whole `Discrete` space, and an answer must name one (`[4]`); anything else is
`Step(valid=False)` and the same agent moves again (the env never sees it). Rewards: after each
`step` PettingZoo's `rewards` holds what that step handed each agent (`_cumulative_rewards`, what
`last()` returns, only collects them until the agent moves again), so a `Step` carries the
`rewards` of its own step and of the dead-agent steps after it, and the returns are their sum.
`options["render"] = "module:fn"`, `fn(env, agent, observation) -> str`, replaces the text.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from flexmarl_core.config import ConfigError
from flexmarl_core.envs.api import Step, Turn, bracketed, load_callable, parse_action, require

Render = Callable[[Any, str, Any], str]


def make(spec: str, rest: str, options: dict[str, Any]) -> PettingZooEnvironment:
    pz = require(spec, "pettingzoo")
    render_ref = options.pop("render", None)
    render = load_callable(f"environment {spec!r}", render_ref, "render") if render_ref else render_plain
    if ":" not in rest:  # a registry id, e.g. classic/tictactoe-v3 (PettingZoo 1.27's `make`)
        if rest not in pz.aec_registry:
            raise ConfigError(f"environment {spec!r}: PettingZoo's AEC registry has no {rest!r} "
                              "(pettingzoo.aec_registry lists them)")
        return _environment(spec, lambda **kw: pz.make("aec", rest, **kw), options, render)
    mod_name, _, fn_name = rest.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(f"environment {spec!r}: write pettingzoo:<module>:<factory> or "
                          "pettingzoo:<registry id>, e.g. pettingzoo:pettingzoo.classic.tictactoe_v3:env")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name and (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            raise ConfigError(f"environment {spec!r}: no module {mod_name!r}") from None
        raise ConfigError(f"environment {spec!r} needs {exc.name} (imported by {mod_name}): "
                          "pip install 'flexmarl[pettingzoo]' or that env family's pettingzoo extra") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise ConfigError(f"environment {spec!r}: module {mod_name!r} has no factory {fn_name!r}")
    return _environment(spec, factory, options, render)


def _environment(spec: str, factory: Callable[..., Any], options: dict[str, Any],
                 render: Render) -> PettingZooEnvironment:
    try:
        probe = factory(**options)
    except ImportError as exc:
        raise ConfigError(f"environment {spec!r} needs more packages: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"environment {spec!r}: bad options {sorted(options)}: {exc}") from None
    seats = tuple(probe.possible_agents)
    if any(not hasattr(probe.action_space(a), "n") for a in seats):
        raise ConfigError(f"environment {spec!r}: only discrete action spaces can be answered in text")
    probe.close()
    return PettingZooEnvironment(lambda: factory(**options), tuple(str(s) for s in seats), render)


def legal_actions(env: Any, agent: str, observation: Any, info: Any) -> tuple[str, ...]:
    """The legal action indices as text: the action mask where there is one, else all of them."""
    mask = None
    if isinstance(observation, dict) and "action_mask" in observation:
        mask = observation["action_mask"]
    elif isinstance(info, dict) and "action_mask" in info:
        mask = info["action_mask"]
    if mask is not None:
        return tuple(str(i) for i, ok in enumerate(mask) if ok)
    return tuple(str(i) for i in range(int(env.action_space(agent).n)))


def _text(value: Any) -> str:
    return str(value.tolist()) if hasattr(value, "tolist") else repr(value)


def render_plain(env: Any, agent: str, observation: Any) -> str:
    """Any AEC env: its name, the agent, the observation's values, the legal action indices."""
    if isinstance(observation, dict):
        seen = "\n".join(f"{k}: {_text(v)}" for k, v in observation.items() if k != "action_mask")
    else:
        seen = _text(observation)
    legal = legal_actions(env, agent, observation, env.infos.get(agent))
    name = env.unwrapped.metadata.get("name", type(env.unwrapped).__name__)
    return (f"Environment: {name}. You are {agent}.\nObservation:\n{seen}\n"
            f"Legal actions: {bracketed(legal)}\nAnswer with exactly one legal action index in brackets.")


class PettingZooEnvironment:
    def __init__(self, build: Callable[[], Any], seats: tuple[str, ...], render: Render) -> None:
        self._build, self.seats, self._render = build, seats, render

    def episode(self, seed: int) -> PettingZooEpisode:
        return PettingZooEpisode(self._build(), self.seats, self._render, seed)


class PettingZooEpisode:
    def __init__(self, env: Any, seats: tuple[str, ...], render: Render, seed: int) -> None:
        self.seats, self.env, self._render = seats, env, render
        self._returns = dict.fromkeys(seats, 0.0)
        self._closed = False
        env.reset(seed=seed)
        self._skip_dead({})

    def _collect(self, into: dict[str, float]) -> None:
        for agent, r in self.env.rewards.items():
            if r:
                into[agent] = into.get(agent, 0.0) + float(r)
                self._returns[agent] = self._returns.get(agent, 0.0) + float(r)

    def _skip_dead(self, into: dict[str, float]) -> None:
        """Step terminated/truncated agents with None until a live one is to move, or none is."""
        env = self.env
        while env.agents:
            agent = env.agent_selection
            if not (env.terminations[agent] or env.truncations[agent]):
                return
            env.step(None)
            self._collect(into)

    def _current(self) -> tuple[str, Any, tuple[str, ...]] | None:
        if not self.env.agents:
            return None
        agent = self.env.agent_selection
        observation, _, _, _, info = self.env.last()
        return agent, observation, legal_actions(self.env, agent, observation, info)

    def turn(self) -> Turn | None:
        current = self._current()
        if current is None:
            return None
        agent, observation, legal = current
        return Turn(agent, self._render(self.env, agent, observation), legal)

    def act(self, text: str) -> Step:
        current = self._current()
        if current is None:
            raise RuntimeError("the episode is over")
        _, _, legal = current
        choice = parse_action(text, legal)
        if choice is None:
            return Step(False, note=f"answer with exactly one legal action index: {bracketed(legal)}")
        handed: dict[str, float] = {}
        self.env.step(int(choice))
        self._collect(handed)
        self._skip_dead(handed)
        return Step(True, handed)

    def returns(self) -> dict[str, float]:
        return dict(self._returns)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.env.close()
