"""A program team in one process: its function, what the endpoint knows of each agent, and one
run of the program over a batch of problems (a program op, an evaluation, SFT's recording).

    team = program_team(cfg)                        # loaded once per process and config
    results, session = team.run(jobs, dispatcher, versions, seed_of)
    rows, status, summary = score(cfg, workload, problems, results, decode)
"""

from __future__ import annotations

import functools
import json
import random
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from flexmarl_core.config import AgentConfig, ConfigError, TeamConfig
from flexmarl_core.models import base_model_dir, load_agent_model, load_tokenizer
from flexmarl_core.programs.api import Dispatcher, MachineryError, TrajectoryResult
from flexmarl_core.programs.capture import last_outputs, trajectory_rows
from flexmarl_core.programs.chat import template_source
from flexmarl_core.programs.engines import DemoDispatcher, LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from flexmarl_core.programs.runner import Job, check_failures, load_program, run_program
from flexmarl_core.programs.tools import TOOL_PARSERS, ToolCall, ToolParser
from flexmarl_core.workloads.api import Problem, SupportsPerturbation, SupportsToolTurns, Workload
from flexmarl_core.workloads.bounded import Deadline


def model_folder(acfg: AgentConfig, seed: int) -> Path:
    m = acfg.model
    folder = m.folder()
    if folder is not None:
        return folder
    assert m.preset is not None
    folder = base_model_dir(m.preset, seed)
    if not (folder / "config.json").is_file():
        load_agent_model(m, seed=seed)  # builds and caches the preset's folder
    return folder


def agent_spec(acfg: AgentConfig, seed: int) -> AgentSpec:
    """What the endpoint needs of `acfg`: its tokenizer, template and context, read from the
    model's folder (no weights are loaded)."""
    folder = model_folder(acfg, seed)
    tok = load_tokenizer(folder)
    max_ctx = int(getattr(AutoConfig.from_pretrained(str(folder)), "max_position_embeddings", 2048))
    return AgentSpec(acfg.name, acfg.sampling, template_source(acfg.chat_template, tok), tok, max_ctx,
                     parser=_parser(acfg))


def _parser(acfg: AgentConfig) -> ToolParser:
    try:
        return TOOL_PARSERS.get(acfg.tool_parser)
    except ValueError as exc:
        raise ConfigError(f"agent {acfg.name!r}: {exc}") from None


@dataclass
class ProgramTeam:
    """The loaded program of `spec` and the endpoint's view of the team's agents."""

    spec: str
    fn: Callable[..., Any]
    agents: dict[str, AgentSpec]
    window_s: float
    output: str
    #: exception types beside `api.POLICY_ERRORS` that are the policy's failure (`team.policy_errors`)
    policy_errors: tuple[str, ...] = ()
    #: the reward of a trajectory the policy broke (`team.failure_reward`)
    failure_reward: float = 0.0

    def run(self, jobs: Sequence[Job], dispatcher: Dispatcher, versions: Mapping[str, int],
            seed_of: Callable[[str, int, str, str], int], *, greedy: bool = False,
            where: str = "program", all_may_fail: bool = False) -> tuple[list[TrajectoryResult], Session]:
        """Every job's trajectory through this process's endpoint; raises `MachineryError` if a
        decode failed, `ProgramError` if every trajectory did (unless `all_may_fail`)."""
        session = Session(secrets.token_urlsafe(16), self.agents, dict(versions), dispatcher, seed_of,
                          window_s=self.window_s, greedy=greedy)
        results = run_program(self.fn, jobs, session, Gateway.shared(), policy_errors=self.policy_errors)
        if session.error is not None:
            raise MachineryError(f"{where}: {session.error}") from session.error
        if not all_may_fail:
            check_failures(self.spec, results, where)
        return results, session

    def outputs(self, res: TrajectoryResult) -> dict[str, str]:
        """What the workload scores of a trajectory: each agent's last answered text, and the
        program's answer as the output agent's (a failed trajectory: nothing, a wrong answer)."""
        if res.error is not None:
            return {}
        return {**last_outputs(res), self.output: res.answer or ""}

    def demonstrations(self, workload: Workload, problems: Sequence[Problem], seed: int,
                       perturb: float) -> dict[str, list[tuple[list[int], str]]]:
        """(prompt ids, target) pairs per agent: the program run on `problems` while the
        endpoint answers from the workload's demonstrations, so the prompts are the ones the
        program really sends. An agent other than the output agent is sometimes answered with
        a plausible mistake (`perturb`, seeded per problem and agent), so later calls learn
        from real errors, as a YAML team's SFT shows them downstream."""
        by_id = {p.input_id: p for p in problems}
        can_perturb = isinstance(workload, SupportsPerturbation) and perturb > 0

        def demo(agent: str, input_id: str, k: int) -> tuple[str, str]:
            p = by_id[input_id]
            turn = workload.tool_turn(p, agent, k) if isinstance(workload, SupportsToolTurns) else None
            if turn is not None:  # a tool loop's k-th turn: a call in the agent's own format, or the answer
                text = turn if isinstance(turn, str) else self.agents[agent].parser.render(ToolCall(*turn))
                return text, text
            target = workload.demonstration(p, agent, {})
            rng = random.Random(f"{seed}:{input_id}:{agent}")
            if can_perturb and agent != self.output and rng.random() < perturb:
                return target, workload.perturbation(p, agent, rng)  # type: ignore[attr-defined]
            return target, target

        d = DemoDispatcher(demo, {a: s.tokenizer for a, s in self.agents.items()})
        self.run([(p.input_id, 0, 0, p.text) for p in problems], d, {a: 0 for a in self.agents},
                 lambda *_: 0, where="SFT demonstrations", all_may_fail=True)
        out: dict[str, list[tuple[list[int], str]]] = {a: [] for a in self.agents}
        for agent, ids, target in sorted(d.pairs, key=lambda x: (x[0], x[1], x[2])):
            out[agent].append((ids, target))
        return out

    def evaluate(self, engines: Mapping[str, Any], problems: Sequence[Problem]) -> list[dict[str, str]]:
        """Greedy outputs of one trajectory per problem on `engines` (this process's)."""
        jobs = [(p.input_id, 0, 0, p.text) for p in problems]
        versions = {a: int(engines[a].version) for a in self.agents}
        results, _ = self.run(jobs, LocalDispatcher.of_engines(engines), versions, lambda *_: 0, greedy=True,
                              where="held-out evaluation", all_may_fail=True)
        return [self.outputs(r) for r in results]

    def decode(self, agent: str, ids: list[int]) -> str:
        return self.agents[agent].tokenizer.decode(ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _cached(team_json: str, seed: int) -> ProgramTeam:
    team = TeamConfig.model_validate_json(team_json)
    if team.program is None:
        raise ValueError("not a program team (team.program is unset)")
    agents = {a.name: agent_spec(a, seed) for a in team.agents}
    output = team.output or team.agents[-1].name
    return ProgramTeam(team.program, load_program(team.program), agents, team.batch_window_ms / 1e3, output,
                       tuple(team.policy_errors), team.failure_reward)


def program_team(team: TeamConfig, seed: int) -> ProgramTeam:
    """The program team `team` declares (its model folders from `seed`), loaded once per process."""
    return _cached(team.model_dump_json(), seed)


@dataclass
class Scored:
    """A batch of trajectories, scored: rows per agent, status rows per agent, and figures."""

    rows: dict[str, list[dict[str, Any]]]
    status: dict[str, list[dict[str, Any]]]
    manifest: dict[int, dict[str, Any]]
    correct: list[float]
    rewards: dict[str, list[float]]
    calls: dict[str, int]


def score(team: ProgramTeam, workload: Workload, problems: Mapping[str, Problem],
          results: Sequence[TrajectoryResult], trainable: set[str], deadline: Deadline | None = None) -> Scored:
    """Rewards of every trajectory that ended with an answer (`workload.reward` on each agent's
    last output, the program's answer as the output agent's, each call within `deadline`), the
    rows of their calls, and per micro-batch the manifest of what was written: the sample ids
    that count, the failures (a trajectory that raised, or whose input's reward hung). A
    trajectory the policy broke (`policy_error`) is listed as failed with `trained: true`, and
    its calls count, rewarded `team.failure_reward` through the workload's credit rule."""
    out = Scored({}, {}, {}, [], {}, {})
    hung: set[str] = set()
    for res in results:
        man = out.manifest.setdefault(res.mb, {"samples": {}, "failed": []})
        broke = res.policy_error is not None and res.input_id not in hung
        if (res.error is not None and not broke) or res.input_id in hung:
            why = res.error or "its input's reward ran past its deadline"
            man["failed"].append({"input_id": res.input_id, "traj": res.traj, "error": why[:500]})
            continue
        problem = problems[res.input_id]
        if broke:
            man["failed"].append({"input_id": res.input_id, "traj": res.traj, "error": (res.error or "")[:500],
                                  "policy_error": res.policy_error, "trained": True})
            rewards, acc = dict.fromkeys(team.agents, team.failure_reward), 0.0
        else:
            outputs = team.outputs(res)

            def scored(p: Problem = problem, o: dict[str, str] = outputs) -> tuple[dict[str, float], float]:
                return workload.reward(p, o), float(workload.is_correct(p, o))

            ok, got = deadline.call(scored, res.input_id) if deadline is not None else (True, scored())
            if not ok or got is None:
                hung.add(res.input_id)
                man["failed"].append({"input_id": res.input_id, "traj": res.traj,
                                      "error": f"the reward ran past its deadline of {deadline.seconds:g} s"})
                continue
            rewards, acc = got
        out.correct.append(acc)
        for agent in team.agents:
            out.calls[agent] = out.calls.get(agent, 0) + sum(1 for r in res.records if r.agent == agent)
        for agent, rs in trajectory_rows(res, team.decode).items():
            if broke:  # the store says which samples a broken trajectory left, and how it broke
                for r in rs:
                    r["extra"] = json.dumps({**json.loads(r["extra"]), "policy_error": res.policy_error})
            given = workload.turn_rewards(problem, agent, [r["response_text"] for r in rs], rewards.get(agent, 0.0))
            out.rows.setdefault(agent, []).extend(rs)
            man["samples"].setdefault(agent, []).extend(r["sample_id"] for r in rs)
            out.rewards.setdefault(agent, []).extend(float(v) for v in given)
            if agent in trainable:
                out.status.setdefault(agent, []).extend(
                    {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": r["mb"],
                     "reward": float(v)} for r, v in zip(rs, given, strict=True))
    return out
