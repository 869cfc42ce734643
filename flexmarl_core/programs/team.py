"""A program team in one process: its function, what the endpoint knows of each agent, and one
run of the program over a batch of problems (a program op, an evaluation, SFT's recording).

    team = program_team(cfg)                        # loaded once per process and config
    results, session = team.run(jobs, dispatcher, versions, seed_of)
    rows, status, summary = score(cfg, workload, problems, results, decode)
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from flexmarl_core.config import AgentConfig, ExperimentConfig
from flexmarl_core.models import base_model_dir, load_agent_model, load_tokenizer
from flexmarl_core.programs.api import Dispatcher, MachineryError, TrajectoryResult
from flexmarl_core.programs.capture import last_outputs, trajectory_rows
from flexmarl_core.programs.chat import template_source
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from flexmarl_core.programs.runner import Job, check_failures, load_program, run_program
from flexmarl_core.workloads.api import Problem, Workload


def _model_folder(acfg: AgentConfig, seed: int) -> Path:
    m = acfg.model
    if m.path is not None:
        return Path(m.path)
    assert m.preset is not None
    folder = base_model_dir(m.preset, seed)
    if not (folder / "config.json").is_file():
        load_agent_model(m, seed=seed)  # builds and caches the preset's folder
    return folder


def agent_spec(acfg: AgentConfig, seed: int) -> AgentSpec:
    """What the endpoint needs of `acfg`: its tokenizer, template and context, read from the
    model's folder (no weights are loaded)."""
    folder = _model_folder(acfg, seed)
    tok = load_tokenizer(folder)
    max_ctx = int(getattr(AutoConfig.from_pretrained(str(folder)), "max_position_embeddings", 2048))
    return AgentSpec(acfg.name, acfg.sampling, template_source(acfg.chat_template, tok), tok, max_ctx)


@dataclass
class ProgramTeam:
    """The loaded program of `spec` and the endpoint's view of the team's agents."""

    spec: str
    fn: Callable[..., Any]
    agents: dict[str, AgentSpec]
    window_s: float
    output: str

    def run(self, jobs: Sequence[Job], dispatcher: Dispatcher, versions: Mapping[str, int],
            seed_of: Callable[[str, int, str, int], int], *, greedy: bool = False,
            where: str = "program") -> tuple[list[TrajectoryResult], Session]:
        """Every job's trajectory through this process's endpoint; raises `MachineryError` if a
        decode failed, `ProgramError` if every trajectory did."""
        session = Session(secrets.token_urlsafe(16), self.agents, dict(versions), dispatcher, seed_of,
                          window_s=self.window_s, greedy=greedy)
        results = run_program(self.fn, jobs, session, Gateway.shared())
        if session.error is not None:
            raise MachineryError(f"{where}: {session.error}") from session.error
        check_failures(self.spec, results, where)
        return results, session

    def decode(self, agent: str, ids: list[int]) -> str:
        return self.agents[agent].tokenizer.decode(ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _cached(config_json: str) -> ProgramTeam:
    cfg = ExperimentConfig.model_validate_json(config_json)
    return _build(cfg)


def _build(cfg: ExperimentConfig) -> ProgramTeam:
    spec = cfg.team.program
    if spec is None:
        raise ValueError("not a program team (team.program is unset)")
    agents = {a.name: agent_spec(a, cfg.seed) for a in cfg.team.agents}
    output = cfg.team.output or cfg.team.agents[-1].name
    return ProgramTeam(spec, load_program(spec), agents, cfg.team.batch_window_ms / 1e3, output)


def program_team(cfg: ExperimentConfig) -> ProgramTeam:
    """The program team of `cfg`, loaded once per process."""
    return _cached(cfg.model_dump_json())


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
          results: Sequence[TrajectoryResult], trainable: set[str]) -> Scored:
    """Rewards of every trajectory that ended with an answer (`workload.reward` on each agent's
    last output, the program's answer as the output agent's), the rows of their calls, and per
    micro-batch the manifest of what was written: the sample ids that count, the failures."""
    out = Scored({}, {}, {}, [], {}, {})
    for res in results:
        man = out.manifest.setdefault(res.mb, {"samples": {}, "failed": []})
        if res.error is not None:
            man["failed"].append({"input_id": res.input_id, "traj": res.traj, "error": res.error[:500]})
            continue
        problem = problems[res.input_id]
        outputs = {**last_outputs(res), team.output: res.answer or ""}
        rewards = workload.reward(problem, outputs)
        out.correct.append(float(workload.is_correct(problem, outputs)))
        for agent in team.agents:
            out.calls[agent] = out.calls.get(agent, 0) + sum(1 for r in res.records if r.agent == agent)
        for agent, rs in trajectory_rows(res, team.decode).items():
            given = workload.turn_rewards(problem, agent, [r["response_text"] for r in rs], rewards.get(agent, 0.0))
            out.rows.setdefault(agent, []).extend(rs)
            man["samples"].setdefault(agent, []).extend(r["sample_id"] for r in rs)
            out.rewards.setdefault(agent, []).extend(float(v) for v in given)
            if agent in trainable:
                out.status.setdefault(agent, []).extend(
                    {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": r["mb"],
                     "reward": float(v)} for r, v in zip(rs, given, strict=True))
    return out
