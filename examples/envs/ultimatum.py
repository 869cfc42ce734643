"""The ultimatum game: the smallest negotiation, and a game whose two seats differ.

Named in a config as `python:examples.envs.ultimatum:Ultimatum` (option: `coins`, default 4).
The proposer offers the responder k of the coins; the responder sees the offer and accepts
(the responder gets k, the proposer the rest) or rejects (nobody gets anything). Rewards are
shares of the pot, so each seat's return is in [0, 1]. The seats answer from different
vocabularies (`[0]`..`[coins]` against `[accept]` / `[reject]`) and want opposite things:
one policy playing both seats has to read which seat it is (SPIRAL's shared policy), where
two models each learn one role (PettingLLMs' role-specific policies).

The game is solved exactly below (`evaluate`): at its subgame-perfect equilibrium the
responder accepts every positive offer and the proposer offers the least, so a learned policy
can be scored against the truth, not only by its training reward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flexmarl_core.envs import Step, Turn, bracketed, parse_action

SEATS = ("proposer", "responder")
ANSWERS = ("accept", "reject")
Probs = Callable[[str, str, tuple[str, ...]], Sequence[float]]


class Ultimatum:
    def __init__(self, coins: int = 4) -> None:
        if coins < 1:
            raise ValueError(f"coins must be at least 1, got {coins}")
        self.coins, self.seats = coins, SEATS

    def episode(self, seed: int) -> UltimatumEpisode:
        return UltimatumEpisode(self.coins)  # no chance in this game: every seed plays alike


def proposer_prompt(coins: int) -> str:
    offers = tuple(str(k) for k in range(coins + 1))
    return (f"Ultimatum game. You are the proposer. Split {coins} coins: offer the responder some. "
            f"If they accept, they get your offer and you keep the rest; if they reject, nobody "
            f"gets anything.\nYour offer: {bracketed(offers)}")


def responder_prompt(coins: int, offer: int) -> str:
    return (f"Ultimatum game. You are the responder. The proposer keeps {coins - offer} of {coins} "
            f"coins and offers you {offer}. Accept and you get {offer}; reject and nobody gets "
            f"anything.\nYour answer: {bracketed(ANSWERS)}")


class UltimatumEpisode:
    def __init__(self, coins: int) -> None:
        self.seats, self.coins = SEATS, coins
        self.offers = tuple(str(k) for k in range(coins + 1))
        self.offer: int | None = None
        self.answer: str | None = None

    def turn(self) -> Turn | None:
        if self.offer is None:
            return Turn("proposer", proposer_prompt(self.coins), self.offers)
        if self.answer is None:
            return Turn("responder", responder_prompt(self.coins, self.offer), ANSWERS)
        return None

    def act(self, text: str) -> Step:
        turn = self.turn()
        if turn is None:
            raise RuntimeError("the episode is over")
        choice = parse_action(text, turn.legal)
        if choice is None:  # the same seat answers again
            return Step(False, note=f"answer with one of {bracketed(turn.legal)}")
        if turn.seat == "proposer":
            self.offer = int(choice)
            return Step(True)
        self.answer = choice
        return Step(True, self.returns())

    def returns(self) -> dict[str, float]:
        if self.answer != "accept" or self.offer is None:
            return dict.fromkeys(SEATS, 0.0)
        return {"proposer": (self.coins - self.offer) / self.coins, "responder": self.offer / self.coins}

    def close(self) -> None:
        pass


def infosets(coins: int = 4) -> list[tuple[str, str, tuple[str, ...]]]:
    """(seat, observation, legal answers) at each decision point: the proposer's one, then the
    responder's for each offer."""
    offers = tuple(str(k) for k in range(coins + 1))
    return [("proposer", proposer_prompt(coins), offers),
            *(("responder", responder_prompt(coins, k), ANSWERS) for k in range(coins + 1))]


def evaluate(probs: Probs, coins: int = 4) -> dict[str, float]:
    """The exact figures of a policy given as probabilities over the legal answers at each
    decision point (`probs(seat, observation, legal)`, normalised here):

    - `value_proposer`, `value_responder`: each seat's expected share of the pot;
    - `accept_rate`: how often a deal is made;
    - `nash_conv`: how much the two seats together would gain by each switching alone to its
      best reply (0 exactly at a Nash equilibrium, the game's ground truth), with
      `gain_proposer` and `gain_responder` its two halves;
    - `offer_mean`: the proposer's mean offer, in coins."""
    points = infosets(coins)
    offer = _norm(probs(*points[0]))
    accept = [_norm(probs(*p))[0] for p in points[1:]]  # P(accept | offer k)
    keep = [(coins - k) / coins for k in range(coins + 1)]
    value_p = sum(offer[k] * accept[k] * keep[k] for k in range(coins + 1))
    value_r = sum(offer[k] * accept[k] * k / coins for k in range(coins + 1))
    gain_p = max(accept[k] * keep[k] for k in range(coins + 1)) - value_p
    gain_r = sum(offer[k] * (1 - accept[k]) * k / coins for k in range(coins + 1))  # best reply: accept k > 0
    return {"value_proposer": value_p, "value_responder": value_r,
            "accept_rate": sum(o * a for o, a in zip(offer, accept, strict=True)),
            "nash_conv": gain_p + gain_r, "gain_proposer": gain_p, "gain_responder": gain_r,
            "offer_mean": sum(k * o for k, o in enumerate(offer))}


def _norm(row: Sequence[float]) -> list[float]:
    xs = [float(x) for x in row]
    if min(xs) < 0 or sum(xs) <= 0:
        raise ValueError(f"probabilities must be non-negative with a positive sum, got {xs}")
    return [x / sum(xs) for x in xs]
