"""Higher/lower: a two-seat number-guessing race, written as a user's own environment.

Named in a config as `python:examples.envs.guess:GuessEnvironment` (options: `high`,
`max_turns`). A secret number in 1..high is drawn from the seed; the seats take turns guessing
and everyone hears "higher" or "lower". Each guess is rewarded on the spot: +0.1 for a guess
inside the range the hints still allow (it halves the search), -0.1 for one outside it (it
ignored a hint), +1 for the right number, which ends the game. After `max_turns` guesses it
ends with no winner. An answer that names no number in 1..high is invalid and the same seat
answers again.
"""

from __future__ import annotations

import random

from flexmarl_core.envs import Step, Turn, parse_action


class GuessEnvironment:
    def __init__(self, high: int = 20, max_turns: int = 10) -> None:
        self.high, self.max_turns = high, max_turns
        self.seats = ("player_0", "player_1")

    def episode(self, seed: int) -> GuessEpisode:
        return GuessEpisode(self, random.Random(seed).randint(1, self.high))


class GuessEpisode:
    def __init__(self, env: GuessEnvironment, secret: int) -> None:
        self.seats, self.max_turns, self.secret = env.seats, env.max_turns, secret
        self.legal = tuple(str(n) for n in range(1, env.high + 1))
        self.low, self.high = 1, env.high  # what the hints so far still allow
        self.history: list[str] = []
        self.guesses = 0
        self.over = False
        self.total = dict.fromkeys(self.seats, 0.0)

    def turn(self) -> Turn | None:
        if self.over:
            return None
        seat = self.seats[self.guesses % len(self.seats)]
        lines = [f"Higher/lower: find the secret number between 1 and {len(self.legal)}, taking "
                 f"turns. You are {seat}. Guesses left: {self.max_turns - self.guesses}.",
                 *(self.history or ["No guesses yet."]),
                 "A guess inside the range the hints allow scores +0.1, outside -0.1; "
                 "the right number scores +1 and ends the game.",
                 "Answer with your guess in brackets, e.g. [10]."]
        return Turn(seat, "\n".join(lines), self.legal)

    def act(self, text: str) -> Step:
        turn = self.turn()
        if turn is None:
            raise RuntimeError("the episode is over")
        choice = parse_action(text, self.legal)
        if choice is None:
            return Step(False, note=f"answer with one whole number from 1 to {len(self.legal)}, e.g. [10]")
        guess, seat = int(choice), turn.seat
        self.guesses += 1
        if guess == self.secret:
            reward, hint, self.over = 1.0, "correct!", True
        else:
            reward = 0.1 if self.low <= guess <= self.high else -0.1
            hint = "higher" if guess < self.secret else "lower"
            if guess < self.secret:
                self.low = max(self.low, guess + 1)
            else:
                self.high = min(self.high, guess - 1)
            self.over = self.guesses >= self.max_turns
        self.history.append(f"{seat} guessed {guess}: {hint}")
        self.total[seat] += reward
        return Step(True, {seat: reward})

    def returns(self) -> dict[str, float]:
        return dict(self.total)

    def close(self) -> None:
        pass
