"""The environment adapters on the real packages (OpenSpiel, TextArena, PettingZoo, a user's
class): seats, turns, legal actions, invalid answers, per-step rewards summing to the returns,
determinism by seed, one-line spec errors, scripted opponents, and Kuhn poker ground truth."""

from __future__ import annotations

import random
import sys

import pytest

from flexmarl_core.config import ConfigError
from flexmarl_core.envs import Step, Turn, kuhn, make_environment, parse_action, scripted_policy
from flexmarl_core.envs.openspiel import render_kuhn

TTT = "pettingzoo:pettingzoo.classic.tictactoe_v3:env"


def play(env, seed, policy="random", first=()):
    """Play one episode to the end: the answers in `first`, then `policy`'s. Returns the
    transcript (seat, observation, answer, step), the summed step rewards and the returns."""
    ep, rng, answer = env.episode(seed), random.Random(seed), scripted_policy(policy)
    transcript, summed = [], {}
    while (turn := ep.turn()) is not None:
        text = first[len(transcript)] if len(transcript) < len(first) else answer(turn, rng)
        step = ep.act(text)
        assert isinstance(step, Step)
        transcript.append((turn.seat, turn.observation, text, step))
        for seat, r in step.rewards.items():
            summed[seat] = summed.get(seat, 0.0) + r
        assert len(transcript) < 500
    returns = ep.returns()
    ep.close()
    assert set(returns) <= set(env.seats)
    for seat in env.seats:
        assert summed.get(seat, 0.0) == pytest.approx(returns.get(seat, 0.0))
    return transcript, summed, returns


def test_parse_action_prefers_the_last_bracketed_legal_action():
    legal = ("pass", "bet")
    assert parse_action("I think [Bet]", legal) == "bet"
    assert parse_action("[pass] no wait, [bet]", legal) == "bet"
    assert parse_action("[fold] then bet", legal) == "bet"  # a bracketed non-action is ignored
    assert parse_action("I bet", legal) == "bet"
    assert parse_action("bet or pass?", legal) is None  # two actions named, none bracketed
    assert parse_action("betting", legal) is None  # whole words only
    assert parse_action("[4]", tuple("012345678")) == "4"
    assert parse_action("anything", ()) is None


def test_openspiel_kuhn_turns_invalid_answers_rewards_and_determinism():
    env = make_environment("openspiel:kuhn_poker")
    assert env.seats == ("player_0", "player_1")
    ep = env.episode(3)
    turn = ep.turn()
    assert turn.seat == "player_0" and turn.legal == ("pass", "bet")
    assert "Your card: " in turn.observation and "[pass] [bet]" in turn.observation
    step = ep.act("I fold")
    assert not step.valid and "[pass] [bet]" in step.note and not step.rewards
    assert ep.turn() == turn  # the same seat, the same view
    assert ep.act("[bet]").valid and ep.turn().seat == "player_1"
    assert "player_0 bet" in ep.turn().observation
    step = ep.act("[bet]")  # call: showdown, 2 chips change hands
    assert step.valid and ep.turn() is None
    assert sorted(step.rewards.values()) == [-2.0, 2.0] and step.rewards == ep.returns()

    infosets = {(s, o, legal) for s, o, legal in kuhn.kuhn_infosets()}
    deals = set()
    for seed in range(12):
        transcript, _, returns = play(env, seed)
        assert sum(returns.values()) == 0.0
        assert all((seat, obs, ("pass", "bet")) in infosets for seat, obs, _, _ in transcript)
        deals.add(transcript[0][1])
        assert play(env, seed)[0] == transcript  # same seed, same answers: same episode
    assert len(deals) == 3  # the seed decides the deal: all three first-player cards show up


def test_openspiel_tic_tac_toe_and_options():
    env = make_environment("openspiel:tic_tac_toe")
    transcript, _, returns = play(env, 0, policy="first")
    assert [t[0] for t in transcript[:3]] == ["player_0", "player_1", "player_0"]
    assert transcript[0][3].valid and "x(0,0)" in transcript[0][1]
    assert returns == {"player_0": 1.0, "player_1": -1.0}  # x fills 0,2,4,6: the anti-diagonal

    plain = make_environment("openspiel:kuhn_poker",
                             {"render": "flexmarl_core.envs.openspiel:render_plain", "players": 3})
    assert plain.seats == ("player_0", "player_1", "player_2")
    assert plain.episode(1).turn().observation.startswith("Game: Kuhn Poker. You are player_0.")
    _, _, returns = play(plain, 1)
    assert sum(returns.values()) == pytest.approx(0.0)


def test_textarena_kuhn_invalid_move_rule_rewards_and_determinism():
    env = make_environment("textarena:KuhnPoker-v0")
    assert env.seats == ("player_0", "player_1")
    ep = env.episode(5)
    turn = ep.turn()
    assert turn.seat == "player_1" and turn.legal == ()  # TextArena's rule: player 1 opens round 1
    assert "Your available actions are: '[check]', '[bet]'" in turn.observation
    step = ep.act("hello")
    assert not step.valid and "attempted an invalid move" in step.note
    again = ep.turn()
    assert again.seat == "player_1" and "attempted an invalid move" in again.observation
    step = ep.act("still no action")  # a second invalid move in a row loses the game
    assert not step.valid and ep.turn() is None
    assert step.rewards == {"player_0": 1.0, "player_1": -1.0} == ep.returns()

    transcript, _, returns = play(env, 5, first=("hello",))
    assert not transcript[0][3].valid and all(t[3].valid for t in transcript[1:])
    assert sorted(returns.values()) in ([-1.0, 1.0], [0.0, 0.0])
    assert transcript[-1][3].rewards == {s: r for s, r in returns.items() if r}
    random.seed(99)  # the global random state in between must not matter
    assert play(env, 5, first=("hello",))[0] == transcript
    assert play(env, 6)[0] != transcript


def test_textarena_tic_tac_toe_plays_to_the_end():
    transcript, _, returns = play(make_environment("textarena:TicTacToe-v0"), 2)
    assert [t[0] for t in transcript[:2]] == ["player_0", "player_1"]
    assert all(t[3].valid for t in transcript) and sum(returns.values()) == 0.0


@pytest.mark.filterwarnings("ignore:The old environment creation API:DeprecationWarning")
def test_pettingzoo_tictactoe_and_per_step_rewards():
    env = make_environment(TTT)
    assert env.seats == ("player_1", "player_2")
    ep = env.episode(0)
    turn = ep.turn()
    assert turn.seat == "player_1" and turn.legal == tuple("012345678")
    assert "[0] [1] [2]" in turn.observation
    for bad in ("[9]", "banana", "3 or 4"):
        assert not ep.act(bad).valid and ep.turn() == turn
    assert ep.act("[4]").valid and ep.turn().legal == tuple("01235678")
    ep.close()
    transcript, _, returns = play(env, 0, policy="first")
    assert returns == {"player_1": 1.0, "player_2": -1.0} and len(transcript) == 7
    assert play(env, 0, policy="first")[0] == transcript

    registry = make_environment("pettingzoo:classic/tictactoe-v3")  # PettingZoo 1.27's registry
    assert registry.seats == env.seats and play(registry, 0, policy="first")[0] == transcript

    rps = make_environment("pettingzoo:classic/rps-v2", {"num_actions": 3, "max_cycles": 6})
    transcript, _, returns = play(rps, 4)
    assert sum(returns.values()) == 0.0
    assert any(t[3].rewards for t in transcript[:-1])  # rewards every round, not only at the end


def test_user_environment_plays_to_the_end_with_per_turn_rewards():
    env = make_environment("python:examples.envs.guess:GuessEnvironment", {"high": 16, "max_turns": 6})
    assert env.seats == ("player_0", "player_1")
    ep = env.episode(1)
    assert not ep.act("no idea").valid and ep.turn().seat == "player_0"
    transcript, _, returns = play(env, 1, policy="first", first=("no idea",))  # guesses 1, 1, ...
    rewarded = [t for t in transcript if t[3].rewards]
    assert len(rewarded) == len(transcript) - 1 and len(rewarded) >= 2
    assert returns["player_0"] == pytest.approx(0.1 - 0.1 - 0.1) and len(transcript) == 7
    assert play(env, 1, policy="first", first=("no idea",))[0] == transcript


def test_spec_errors_are_one_line_naming_the_spec(monkeypatch):
    cases = {
        "gym:CartPole-v1": "unknown kind",
        "openspiel:no_such_game": "OpenSpiel has no game 'no_such_game'",
        "textarena:NoSuchGame-v0": "TextArena has no env 'NoSuchGame-v0'",
        "pettingzoo:no_such_module:env": "no module 'no_such_module'",
        "pettingzoo:pettingzoo.classic.tictactoe_v3:nope": "has no factory 'nope'",
        "pettingzoo:classic/nope-v1": "AEC registry has no 'classic/nope-v1'",
        "python:examples.envs.guess:Nope": "has no callable 'Nope'",
        "python:collections:OrderedDict": "does not implement Environment: missing episode, seats",
    }
    for spec, text in cases.items():
        with pytest.raises(ConfigError) as err:
            make_environment(spec)
        message = str(err.value)
        assert "\n" not in message and repr(spec) in message and text in message, message
    monkeypatch.setitem(sys.modules, "pyspiel", None)  # as if open_spiel were not installed
    with pytest.raises(ConfigError, match=r"^environment 'openspiel:kuhn_poker' needs open_spiel: "
                                          r"pip install 'flexmarl\[openspiel\]'"):
        make_environment("openspiel:kuhn_poker")


def test_scripted_policies():
    turn, rng = Turn("player_0", "board", ("a", "b", "c")), random.Random(0)
    assert scripted_policy("first")(turn, rng) == "[a]"
    assert {scripted_policy("random")(turn, rng) for _ in range(50)} == {"[a]", "[b]", "[c]"}
    free = Turn("player_0", "rules: '[x]' means...\nYour available actions are: '[check]', '[bet]'\n"
                            "Player 0 attempted an invalid move. Reason: use [Check], [Fold].")
    assert {scripted_policy("random")(free, rng) for _ in range(30)} == {"[check]", "[bet]"}
    mine = scripted_policy("python:flexmarl_core.envs.scripted:first_policy")
    assert mine(turn, rng) == "[a]"
    with pytest.raises(ConfigError, match="unknown"):
        scripted_policy("nope")
    nash = scripted_policy("openspiel:kuhn_nash")
    kuhn_turn = make_environment("openspiel:kuhn_poker").episode(0).turn()
    assert nash(kuhn_turn, rng) in ("[pass]", "[bet]")


def test_kuhn_ground_truth():
    infosets = kuhn.kuhn_infosets()
    assert len(infosets) == 12 and len({o for _, o, _ in infosets}) == 12
    assert all(legal == ("pass", "bet") for _, _, legal in infosets)

    def uniform(seat, observation, legal):
        return [1.0] * len(legal)

    assert kuhn.exploitability(uniform) == pytest.approx(0.4583333333333333, abs=1e-9)
    assert kuhn.nash_conv(uniform) == pytest.approx(2 * 0.4583333333333333, abs=1e-9)
    for alpha in (0.0, 0.2, 1 / 3):
        assert kuhn.exploitability(kuhn.nash_probs(alpha)) == pytest.approx(0.0, abs=1e-9)
    assert kuhn.game_value() == pytest.approx(-1 / 18, abs=1e-12)

    from open_spiel.python.algorithms import cfr

    solver = cfr.CFRSolver(kuhn._game())
    for _ in range(300):
        solver.evaluate_and_update_policy()
    average = solver.average_policy()
    index = {render_kuhn(s, s.current_player()): key for key, s in kuhn._infosets(kuhn._game()).items()}

    def cfr_probs(seat, observation, legal):
        return list(average.policy_for_key(index[observation]))

    assert kuhn.exploitability(cfr_probs) < 0.01

    assert kuhn.value_vs_random(uniform, "player_0") == pytest.approx(0.125)
    assert kuhn.value_vs_random(kuhn.nash_probs(), "player_1") == pytest.approx(1 / 6)
    assert kuhn.win_rate_vs_random(uniform, "player_0") == pytest.approx(0.5625)
    with pytest.raises(ValueError, match="non-negative"):
        kuhn.exploitability(lambda s, o, legal: [1.0])


def test_the_ultimatum_game_pays_shares_and_is_solved_exactly():
    from examples.envs.ultimatum import evaluate, infosets

    env = make_environment("python:examples.envs.ultimatum:Ultimatum", {"coins": 4})
    ep = env.episode(0)
    assert ep.turn().seat == "proposer" and not ep.act("half").valid and ep.turn().seat == "proposer"
    assert ep.act("[1]").valid and ep.turn().seat == "responder" and "offers you 1" in ep.turn().observation
    assert ep.act("[accept]").rewards == {"proposer": 0.75, "responder": 0.25} and ep.turn() is None
    rejected = env.episode(0)
    rejected.act("[3]")
    rejected.act("reject")
    assert rejected.returns() == {"proposer": 0.0, "responder": 0.0}
    # ground truth: uniform play is 0.5 from equilibrium; offering 0 and accepting all is one
    uniform = evaluate(lambda seat, obs, legal: [1.0] * len(legal))
    assert uniform["nash_conv"] == pytest.approx(0.5) and uniform["accept_rate"] == pytest.approx(0.5)
    spe = evaluate(lambda seat, obs, legal: [1.0, 0, 0, 0, 0] if seat == "proposer" else [1.0, 0.0])
    assert spe["nash_conv"] == pytest.approx(0.0) and spe["value_proposer"] == pytest.approx(1.0)
    # a responder who rejects everything leaves the proposer nothing to gain and herself the offer
    stubborn = evaluate(lambda seat, obs, legal: [0, 0, 1.0, 0, 0] if seat == "proposer" else [0.0, 1.0])
    assert stubborn["gain_responder"] == pytest.approx(0.5) and stubborn["gain_proposer"] == pytest.approx(0.0)
    assert [s for s, _, _ in infosets(4)] == ["proposer"] + ["responder"] * 5
