"""Kuhn poker ground truth for the learning benchmark, by OpenSpiel's exact algorithms.

Kuhn poker is small enough to solve exactly: 12 decision points, a known Nash family, game value
-1/18 for player_0. A policy is given the way the model plays, as probabilities over the legal
action texts at each decision point, from the same observation text the adapter renders
(`probs(seat, observation, legal)`), so what the benchmark scores is exactly what was trained.
Exploitability (0 at Nash, 0.458333... for uniform random) and values against a uniform random
opponent are OpenSpiel's own (`exploitability`, `nash_conv`, `expected_game_score.policy_value`
over a `TabularPolicy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from flexmarl_core.envs.api import require
from flexmarl_core.envs.openspiel import legal_texts, render_kuhn

Probs = Callable[[str, str, tuple[str, ...]], Sequence[float]]
#: an information state as text: `render(state, player)` (the adapter's, or `options.render`)
Render = Callable[[Any, int], str]
GAME = "kuhn_poker"
SEATS = ("player_0", "player_1")


def _game() -> Any:
    return require(f"openspiel:{GAME}", "pyspiel").load_game(GAME)


def _decisions(state: Any) -> Iterator[Any]:
    """Every decision state of the tree below `state` (chance branches included)."""
    if state.is_terminal():
        return
    if not state.is_chance_node():
        yield state
    for action in ([a for a, _ in state.chance_outcomes()] if state.is_chance_node()
                   else state.legal_actions()):
        yield from _decisions(state.child(action))


def _infosets(game: Any) -> dict[str, Any]:
    """OpenSpiel's information-state key -> one state of that information set."""
    out: dict[str, Any] = {}
    for s in _decisions(game.new_initial_state()):
        out.setdefault(s.information_state_string(s.current_player()), s)
    return out


def kuhn_infosets(render: Render = render_kuhn) -> list[tuple[str, str, tuple[str, ...]]]:
    """(seat, observation text as the adapter renders it, legal action texts) for each of the
    12 decision points, player_0's first (`render`: the config's `options.render`)."""
    found = [(s.current_player(), key, s) for key, s in _infosets(_game()).items()]
    return [(SEATS[p], render(s, p), legal_texts(s, p)) for p, _, s in sorted(found, key=lambda x: x[:2])]


def tabular_policy(probs: Probs, seats: Sequence[str] = SEATS,
                   render: Render = render_kuhn) -> Any:
    """An OpenSpiel `TabularPolicy` playing `probs` in `seats` and uniform random elsewhere."""
    from open_spiel.python.policy import TabularPolicy

    game = _game()
    policy = TabularPolicy(game)
    for key, s in _infosets(game).items():
        p = s.current_player()
        if SEATS[p] not in seats:
            continue
        legal = legal_texts(s, p)
        row = [float(x) for x in probs(SEATS[p], render(s, p), legal)]
        if len(row) != len(legal) or min(row) < 0 or sum(row) <= 0:
            raise ValueError(f"probs for {SEATS[p]} over {legal} must be {len(legal)} non-negative "
                             f"numbers with a positive sum, got {row}")
        table = policy.policy_for_key(key)
        table[:] = 0.0
        for action, x in zip(s.legal_actions(), row, strict=True):
            table[action] = x / sum(row)
    return policy


def exploitability(probs: Probs, render: Render = render_kuhn) -> float:
    """OpenSpiel's exploitability of the joint policy (NashConv / 2): 0 at Nash."""
    from open_spiel.python.algorithms import exploitability as ex

    return float(ex.exploitability(_game(), tabular_policy(probs, render=render)))


def nash_conv(probs: Probs, render: Render = render_kuhn) -> float:
    from open_spiel.python.algorithms import exploitability as ex

    return float(ex.nash_conv(_game(), tabular_policy(probs, render=render)))


def value_vs_random(probs: Probs, seat: str, render: Render = render_kuhn) -> float:
    """The exact expected return of `probs` playing `seat` against a uniform random opponent."""
    from open_spiel.python.algorithms.expected_game_score import policy_value

    policy = tabular_policy(probs, seats=(seat,), render=render)
    return float(policy_value(_game().new_initial_state(), [policy, policy])[SEATS.index(seat)])


def win_rate_vs_random(probs: Probs, seat: str, render: Render = render_kuhn) -> float:
    """The exact probability that `probs` in `seat` ends with a positive return against a
    uniform random opponent (walks the 30 terminal histories)."""
    policy = tabular_policy(probs, seats=(seat,), render=render)
    me = SEATS.index(seat)

    def walk(state: Any) -> float:
        if state.is_terminal():
            return float(state.returns()[me] > 0)
        moves = (state.chance_outcomes() if state.is_chance_node()
                 else policy.action_probabilities(state).items())
        return sum(p * walk(state.child(a)) for a, p in moves if p > 0)

    return walk(_game().new_initial_state())


def nash_probs(alpha: float = 0.0) -> Probs:
    """The Kuhn Nash equilibrium family (player_0 bets J with `alpha` in [0, 1/3], K with 3
    alpha, calls with Q with alpha + 1/3; player_1's strategy is fixed)."""
    if not 0.0 <= alpha <= 1 / 3:
        raise ValueError(f"alpha must be in [0, 1/3], got {alpha}")
    bet = {  # (player, history) -> probability of 'bet' (bet or call) by card J, Q, K
        (0, ""): (alpha, 0.0, 3 * alpha),
        (0, "pb"): (0.0, alpha + 1 / 3, 1.0),
        (1, "p"): (1 / 3, 0.0, 1.0),
        (1, "b"): (0.0, 1 / 3, 1.0),
    }
    table: dict[str, tuple[float, float]] = {}
    for key, s in _infosets(_game()).items():
        p = s.current_player()
        x = bet[(p, key[1:])][int(key[0])]
        table[render_kuhn(s, p)] = (1.0 - x, x)  # legal texts are ('pass', 'bet')

    def probs(seat: str, observation: str, legal: tuple[str, ...]) -> Sequence[float]:
        if observation not in table:
            raise ValueError("the Kuhn Nash policy reads kuhn_poker's default rendering only; "
                             f"{seat} was shown: {observation[:80]!r}...")
        return table[observation]

    return probs


def game_value() -> float:
    """player_0's value of the game (-1/18), from a Nash policy by `policy_value`."""
    from open_spiel.python.algorithms.expected_game_score import policy_value

    policy = tabular_policy(nash_probs(0.0))
    return float(policy_value(_game().new_initial_state(), [policy, policy])[0])
