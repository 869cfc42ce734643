"""OpenSpiel games as environments: `openspiel:<game_name>`.

OpenSpiel has exact game trees and exact solvers, so it is where learning can be measured against
ground truth (kuhn.py). Chance is resolved here from `random.Random(seed)`, so a seed fixes the
deal. The text a seat sees is rendered from what that player may know (the information state in
imperfect-information games, the board otherwise); kuhn_poker has a plain-words renderer and any
game's can be replaced with `options["render"] = "module:fn"`, `fn(state, player) -> str`. The
other options are game parameters. Per-step rewards are the change in `state.returns()` over the
step (the move and the chance that follows it), so they sum to the returns exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from flexmarl_core.config import ConfigError
from flexmarl_core.envs.api import Step, Turn, bracketed, load_callable, parse_action, require

Render = Callable[[Any, int], str]
KUHN_CARDS = "JQK"


def make(spec: str, game_name: str, options: dict[str, Any]) -> OpenSpielEnvironment:
    pyspiel = require(spec, "pyspiel")
    render_ref = options.pop("render", None)
    if game_name.split("(")[0] not in pyspiel.registered_names():
        raise ConfigError(f"environment {spec!r}: OpenSpiel has no game {game_name!r} "
                          "(pyspiel.registered_names() lists them)")
    try:
        game = pyspiel.load_game(game_name, options) if options else pyspiel.load_game(game_name)
    except pyspiel.SpielError as exc:
        raise ConfigError(f"environment {spec!r}: {str(exc).splitlines()[0]}") from None
    if game.get_type().dynamics == pyspiel.GameType.Dynamics.SIMULTANEOUS:
        game = pyspiel.convert_to_turn_based(game)  # one seat at a time, as the team loop plays
    render = load_callable(f"environment {spec!r}", render_ref, "render") if render_ref else default_renderer(game)
    return OpenSpielEnvironment(game, render)


def action_text(state: Any, player: int, action: int) -> str:
    """The text of `action` that an answer names: OpenSpiel's own, lower-cased for kuhn_poker."""
    text = state.action_to_string(player, action)
    return text.lower() if state.get_game().get_type().short_name == "kuhn_poker" else text


def legal_texts(state: Any, player: int) -> tuple[str, ...]:
    return tuple(action_text(state, player, a) for a in state.legal_actions(player))


def default_renderer(game: Any) -> Render:
    return render_kuhn if game.get_type().short_name == "kuhn_poker" else render_plain


def render_plain(state: Any, player: int) -> str:
    """Any game: its name, the seat, what the player may know, and the legal actions."""
    gtype = state.get_game().get_type()
    perfect = gtype.information == gtype.information.PERFECT_INFORMATION
    if (perfect or not gtype.provides_information_state_string) and gtype.provides_observation_string:
        seen = state.observation_string(player)
    elif gtype.provides_information_state_string:
        seen = state.information_state_string(player)
    else:
        seen = str(state) if perfect else ""
    return (f"Game: {gtype.long_name}. You are player_{player}.\n{seen}\n"
            f"Legal actions: {bracketed(legal_texts(state, player))}\n"
            "Answer with exactly one legal action in brackets.")


def render_kuhn(state: Any, player: int) -> str:
    """kuhn_poker in words, from the information state only (card, then p/b per action)."""
    info = state.information_state_string(player)
    n = state.get_game().num_players()
    card = KUHN_CARDS[int(info[0])] if n == 2 else f"rank {int(info[0]) + 1} of {n + 1}"
    deck = "a 3-card deck (J < Q < K)" if n == 2 else f"a {n + 1}-card deck (rank 1 lowest)"
    said = {"p": "passed", "b": "bet"}
    history = [f"player_{i % n} {said[c]}" for i, c in enumerate(info[1:])]
    facing = "b" in info[1:]
    return (
        f"Kuhn poker with {n} players and {deck}. Each player antes 1 chip and gets one card; "
        "player_0 acts first. 'bet' puts 1 more chip in (a bet, or a call when facing a bet); "
        "'pass' puts none in (a check, or a fold when facing a bet). The highest card among "
        "those who did not fold wins the pot.\n"
        f"You are player_{player}. Your card: {card}.\n"
        f"Betting so far: {', '.join(history) if history else 'none, you act first'}.\n"
        + ("You are facing a bet: [bet] calls, [pass] folds.\n" if facing else "")
        + f"Legal actions: {bracketed(legal_texts(state, player))}\n"
        "Answer with exactly one legal action in brackets."
    )


def render_kuhn_short(state: Any, player: int) -> str:
    """kuhn_poker in a few tokens, the card last but one line (a small model attends to what is
    near its answer): `options.render: flexmarl_core.envs.openspiel:render_kuhn_short`."""
    info = state.information_state_string(player)
    said = {"p": "pass", "b": "bet"}
    history = " ".join(said[c] for c in info[1:]) or "-"
    return f"P{player} bets: {history}\ncard {KUHN_CARDS[int(info[0])]}\n{bracketed(legal_texts(state, player))}"


class OpenSpielEnvironment:
    def __init__(self, game: Any, render: Render) -> None:
        self.game, self.render = game, render
        self.seats = tuple(f"player_{i}" for i in range(game.num_players()))

    def episode(self, seed: int) -> OpenSpielEpisode:
        return OpenSpielEpisode(self, seed)


class OpenSpielEpisode:
    def __init__(self, env: OpenSpielEnvironment, seed: int) -> None:
        self.seats, self._render = env.seats, env.render
        self._rng = random.Random(seed)
        self.state = env.game.new_initial_state()
        self._resolve_chance()

    def _resolve_chance(self) -> None:
        while self.state.is_chance_node():
            actions, probs = zip(*self.state.chance_outcomes(), strict=True)
            self.state.apply_action(self._rng.choices(actions, weights=probs)[0])

    def turn(self) -> Turn | None:
        if self.state.is_terminal():
            return None
        p = self.state.current_player()
        return Turn(self.seats[p], self._render(self.state, p), legal_texts(self.state, p))

    def act(self, text: str) -> Step:
        if self.state.is_terminal():
            raise RuntimeError("the episode is over")
        p = self.state.current_player()
        legal = legal_texts(self.state, p)
        choice = parse_action(text, legal)
        if choice is None:
            return Step(False, note=f"answer with exactly one legal action: {bracketed(legal)}")
        before = self.state.returns()
        self.state.apply_action(self.state.legal_actions(p)[legal.index(choice)])
        self._resolve_chance()
        after = self.state.returns()
        return Step(True, {s: after[i] - before[i] for i, s in enumerate(self.seats) if after[i] != before[i]})

    def returns(self) -> dict[str, float]:
        return {s: float(r) for s, r in zip(self.seats, self.state.returns(), strict=True)}

    def close(self) -> None:
        pass
