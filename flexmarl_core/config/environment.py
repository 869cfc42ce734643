"""`team.environment`: a team that plays an environment (`teams/environment.py`). The
environment decides whose turn it is; each seat is played by an agent of the team (trained, or
frozen with `trainable: false`) or by a scripted policy."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flexmarl_core.config.agent import _Strict


class SeatConfig(_Strict):
    agent: str | None = Field(None, description="The agent that plays this seat (several seats may share one).")
    frozen: bool = Field(
        False, description="The agent plays this seat at its starting weights (version 0: its SFT start or its "
        "model) whatever it has learned since, and these answers train nobody: an opponent that does not learn.")
    pool: bool = Field(
        False, description="The agent plays this seat at a version drawn per episode from the ones the run keeps "
        "below its current one (version 0 and every `train.keep_every`-th: fictitious self-play against its past "
        "selves), and these answers train nobody. Needs `train.keep_every`.")
    scripted: str | None = Field(
        None, description="A scripted policy plays this seat instead: random (uniform over the legal moves), "
        "first, openspiel:kuhn_nash, or python:<module>:<function> `(turn, rng) -> answer`.")

    @model_validator(mode="after")
    def _one(self) -> SeatConfig:
        if (self.agent is None) == (self.scripted is None):
            raise ValueError("a seat names exactly one of `agent` or `scripted`")
        if (self.frozen or self.pool) and self.agent is None:
            raise ValueError("`frozen` and `pool` are for a seat an agent plays")
        if self.frozen and self.pool:
            raise ValueError("a seat is `frozen` (version 0) or plays a `pool` of versions, not both")
        return self


    @property
    def learns(self) -> bool:
        """Whether this seat's answers are samples of its agent (not frozen, not a pool)."""
        return self.agent is not None and not self.frozen and not self.pool


class EnvironmentConfig(_Strict):
    spec: str = Field(
        description="The environment: openspiel:<game>, textarena:<env id>, pettingzoo:<module>:<factory> "
        "(or pettingzoo:<registry id>), or python:<module>:<Class> (your own class, docs/environments.md).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Game parameters and adapter settings (e.g. OpenSpiel `render: "
        "module:function` to replace the text rendering of an information state); a user class gets them as "
        "keyword arguments.")
    seats: dict[str, SeatConfig] = Field(
        description="Each seat of the environment (player_0, player_1, ...) -> who plays it: an agent's "
        "name, or {scripted: <policy>}.")
    samples: Literal["per_turn", "multi_turn"] = Field(
        "per_turn", description="per_turn: each answer of a seat is one sample, prompted with what the seat "
        "sees then. multi_turn: the seat's answers in an episode form one sample, its prompt continued with "
        "each new observation (masked, as a tool's output is).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of a seat's later rewards in the return "
                         "its answer is credited with.")
    invalid_penalty: float = Field(-1.0, description="Added to the reward of an answer the environment "
                                   "refused (not a legal move).")
    max_invalid: int = Field(2, ge=1, le=100, description="Refused answers a seat may give on one turn; past "
                             "it the seat forfeits and the episode ends there.")
    max_turns: int = Field(64, ge=1, le=10_000, description="Answers per episode, all seats together; past "
                           "it the episode ends as it stands.")
    eval_opponent: str = Field("random", description="The scripted policy every other seat plays in the "
                               "held-out evaluation, which reports the trained agents' win rate against it.")

    @field_validator("seats", mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        # `player_0: solver` for `player_0: {agent: solver}`
        if isinstance(v, dict):
            return {k: {"agent": s} if isinstance(s, str) else s for k, s in v.items()}
        return v

    @field_validator("seats")
    @classmethod
    def _some(cls, v: dict[str, SeatConfig]) -> dict[str, SeatConfig]:
        if not v:
            raise ValueError("name at least one seat")
        return v

    def agents(self) -> list[str]:
        """The agents that play a seat, in seat order, each once."""
        return list(dict.fromkeys(s.agent for s in self.seats.values() if s.agent is not None))
