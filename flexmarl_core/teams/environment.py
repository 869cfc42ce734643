"""The environment team: the team plays an environment (a game, a shared-state task) that
decides whose turn it is (`team.environment`, docs/environments.md). One `episode` op per
micro-batch (without `dependency_parallel`: one for the batch) plays its inputs' episodes,
group size each, every seat's agent decoding on its instances; each trainable agent's answers
become its samples, credited with their seat's return; a manifest per micro-batch lists the
sample ids the op committed (`programs/manifest.py`, as a program op's).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flexmarl_core.config import ConfigError
from flexmarl_core.envs import make_environment
from flexmarl_core.envs.api import Environment
from flexmarl_core.envs.play import Pending, Played, against, play, seat_agents
from flexmarl_core.meg import MEG
from flexmarl_core.programs.api import DecodeGroup, DecodeStats, Dispatcher
from flexmarl_core.programs.chat import render, template_source
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.manifest import committed_ids
from flexmarl_core.teams.api import (
    Demonstrations,
    Generation,
    PlanView,
    RunView,
    hosted_generation,
    register_shape,
)

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.workloads.api import Problem, Workload

#: what the held-out evaluation's output agent "answers" for an episode its seat won; the
#: episodes workload (`envs/seeds.py`) holds this as every problem's answer
WIN = "win"


@register_shape("environment")
class EnvironmentTeam:
    """A team declared as `team.environment`."""

    trajectory_groups = False  # groups: an input's episodes (one deal), an agent's k-th answers

    def __init__(self, cfg: ExperimentConfig) -> None:
        if cfg.team.environment is None:
            raise ConfigError("team.shape environment needs team.environment (its spec and seats)")
        self.cfg, self.ecfg = cfg, cfg.team.environment
        self.meg = MEG.from_config(cfg.team)
        # built now, so a missing package or a seat the game does not have stops the run at start
        self.env: Environment = make_environment(self.ecfg.spec, self.ecfg.options)
        if any(s.pool for s in self.ecfg.seats.values()) and not cfg.train.keep_every:
            raise ConfigError("team.environment.seats: a `pool` seat plays versions the run keeps; set "
                              "train.keep_every (e.g. 5) so that there are some beside version 0")
        if set(self.ecfg.seats) != set(self.env.seats):
            raise ConfigError(f"team.environment.seats names {sorted(self.ecfg.seats)}; environment "
                              f"{self.ecfg.spec!r} has seats {list(self.env.seats)}: map each of them")

    def generation(self, plan: PlanView, it: int) -> Generation:
        """An episode may give a turn to any seat, so it waits for every agent's gating weights."""
        return hosted_generation(plan, it, "episode", self.meg.agent_names)

    def expected_ids(self, run: RunView, it: int, mbs: Sequence[int], agent: str, *,
                     trained: bool = True) -> set[str]:
        """Episodes vary in length: exactly what the ops' manifests list."""
        return committed_ids(run.loc, it, mbs, agent)

    def play(self, jobs: Sequence[tuple[str, int, int]], dispatcher: Dispatcher, versions: Mapping[str, int],
             seed_of: Callable[..., int], *, greedy: bool = False, seats: Mapping[str, str | None] | None = None,
             decodes: list[tuple[str, DecodeStats]] | None = None) -> list[Played]:
        """Play the jobs' episodes (input_id, traj, mb), each agent's pending seats decoded in
        one batch per round on `dispatcher` at `versions`; `decodes` collects what each decode
        measured."""
        def reply(pending: list[Pending]) -> None:
            by_agent: dict[tuple[str, int], list[Pending]] = {}
            for q in pending:  # a frozen seat or a pool decodes at its agent's past weights
                v = self.version(q.answer.seat, q.answer.agent, versions[q.answer.agent], q.played.input_id,
                                 q.played.traj)
                by_agent.setdefault((q.answer.agent, v), []).append(q)
            for (agent, version), qs in by_agent.items():
                acfg = self.cfg.agent(agent)
                sampling = acfg.sampling.model_copy(update={"temperature": 0.0}) if greedy else acfg.sampling
                groups = []
                for q in qs:
                    q.answer.prompt_ids, q.answer.prompt_text = self.prompt(agent, q.answer.messages)
                    seed = seed_of(q.played.input_id, q.played.traj, agent, q.answer.k)
                    groups.append(DecodeGroup(tuple(q.answer.prompt_ids), sampling, seed, 1,
                                              (q.played.input_id, q.played.traj)))
                stats = DecodeStats()
                gens = dispatcher.decode(agent, version, groups, stats)
                if decodes is not None:
                    decodes.append((agent, stats))
                for q, g in zip(qs, gens, strict=True):
                    q.answer.reply, q.answer.text = g[0], g[0].text
        return play(self.env, self.ecfg, seat_agents(self.ecfg) if seats is None else seats, jobs, reply)

    def version(self, seat: str, agent: str, current: int, input_id: str, traj: int) -> int:
        """The weights version `seat` plays at in one episode: the agent's `current` one where it
        learns; 0 where frozen; for a pool, one drawn per episode (seeded by it) from version 0
        and every `train.keep_every`-th below `current` (the versions the run keeps)."""
        s = self.ecfg.seats[seat]
        if s.learns:
            return current
        every = self.cfg.train.keep_every or 0
        pool = [0, *range(every, current, every)] if s.pool and every else [0]
        return random.Random(f"{input_id}:{traj}:{seat}:pool").choice(pool)

    def prompt(self, agent: str, messages: list[dict[str, str]]) -> tuple[list[int], str]:
        """(token ids, text) of `agent`'s prompt for a seat's conversation: its `system`
        message, then the conversation, through its chat template."""
        tok, source, system = self._chat(agent)
        text = render(source, [*system, *messages], tok)
        return tok.encode(text, add_special_tokens=False), text

    def action_probs(self, agent: str, model: Any, observation: str, legal: Sequence[str]) -> list[float]:
        """The probability `model` (`agent`'s) gives each legal action at a decision point,
        among the legal ones: each answered as `[action]`, scored token by token after the
        prompt the seat sees (what exploitability is computed from, `envs/kuhn.py`)."""
        import torch

        from flexmarl_core.models.logprobs import token_logprobs

        ids, _ = self.prompt(agent, [{"role": "user", "content": observation}])
        tok, scores = self.tokenizer(agent), []
        with torch.no_grad():
            for action in legal:
                answer = tok.encode(f"[{action}]", add_special_tokens=False)
                seq = torch.tensor([ids + answer])
                logits = model(seq).logits[0, len(ids) - 1:-1]
                scores.append(float(token_logprobs(logits, seq[0, len(ids):]).sum()))
        return torch.softmax(torch.tensor(scores, dtype=torch.float64), 0).tolist()

    def tokenizer(self, agent: str) -> Any:
        return self._chat(agent)[0]

    @functools.cache  # noqa: B019  (one shape per run and process: the cache lives as long)
    def _chat(self, agent: str) -> tuple[Any, str, list[dict[str, str]]]:
        from flexmarl_core.models import load_tokenizer
        from flexmarl_core.programs.team import model_folder

        acfg = self.cfg.agent(agent)
        tok = load_tokenizer(model_folder(acfg, self.cfg.seed))
        system = [{"role": "system", "content": acfg.system}] if acfg.system is not None else []
        return tok, template_source(acfg.chat_template, tok), system

    def outputs(self, workload: Workload, engines: Mapping[str, Any], problems: Sequence[Problem],
                *, seed: int, greedy: bool) -> list[dict[str, str]]:
        """Problem i is one episode with the i-th agent-played seat (in turn) against the
        scripted `eval_opponent` in every other seat; the output agent's "answer" is `win` if
        that seat's outcome is positive (the held-out accuracy is the win rate)."""
        played_seats = [s for s, c in self.ecfg.seats.items() if c.learns]
        versions = {a: int(engines[a].version) for a in self.meg.agent_names}
        disp = LocalDispatcher.of_engines(engines)
        out: list[dict[str, str]] = []
        for k, seat in enumerate(played_seats):
            mine = [(p.input_id, 0, 0) for i, p in enumerate(problems) if i % len(played_seats) == k]
            for p in self.play(mine, disp, versions, lambda *parts: seed, greedy=greedy, seats=against(self.ecfg, seat)):
                out.append((p.input_id, {self.meg.output or "": WIN if p.returns.get(seat, 0.0) > 0 else "loss"}))  # type: ignore[arg-type]
        by_id = dict(out)  # type: ignore[arg-type]
        return [by_id[p.input_id] for p in problems]

    def demonstrations(self, workload: Workload, problems: Sequence[Problem], *, seed: int,
                       rng: random.Random, perturb: float) -> Demonstrations:
        """Legal play: every seat scripted by `eval_opponent` (random legal moves by default),
        each agent's seats recorded as (the prompt it would see, the move played)."""
        pairs: Demonstrations = {a: [] for a in self.meg.agent_names}
        scripted = {s: None for s in self.ecfg.seats}
        for p in play(self.env, self.ecfg, scripted, [(q.input_id, 0, 0) for q in problems], lambda _: None):
            for a in p.answers:
                agent = self.ecfg.seats[a.seat].agent
                if agent is not None and a.valid:
                    pairs[agent].append((self.prompt(agent, a.messages)[1], a.text))
        return pairs

    def call_order(self) -> dict[tuple[str, int], int]:
        raise ValueError("an environment team's turns are the environment's to order; use algorithm.advantage "
                         "grpo (or another group- or batch-scoped estimator)")
