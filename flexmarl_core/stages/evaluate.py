"""Held-out evaluation of the team (not an op of the iteration graph: flows and `flexmarl eval`
call it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl_core.config import TeamConfig
from flexmarl_core.driver.evaluate import evaluate_team
from flexmarl_core.runtime.worker import context
from flexmarl_core.stages.registry import weights_version
from flexmarl_core.workloads.api import Problem


def through_program(team: TeamConfig, program: str) -> TeamConfig:
    """`team`'s agents called by `program` (`module:function` or `file.py:function`) instead of
    its edges or its own program, graded on the same output agent. Raises ValueError (pydantic's)
    for a bad spec or a file that is not there."""
    from flexmarl_core.meg import MEG

    data = team.model_dump()
    data.update(shape="program", program=program, edges=[], rounds=1, environment=None,
                output=MEG.from_config(team).output)
    return TeamConfig.model_validate(data)


def evaluate(run_dir: str, iteration: int, *, versions: Mapping[str, int] | None = None,
             problems: Sequence[Problem] | None = None, program: str | None = None) -> dict[str, Any]:
    """Greedy held-out accuracy of the team with the weights that iteration `iteration` uses
    (`iteration = train.iterations` evaluates the final weights), or with each agent's
    `versions`; on the workload's held-out set (`workload.heldout_size`), or on `problems`;
    through the run's own team, or through `program` (`through_program`) on the same engines."""
    ctx = context(run_dir)
    team, workload = ctx.team, ctx.workload
    if program is not None:
        from flexmarl_core.teams import team_shape
        from flexmarl_core.workloads import make_workload

        cfg = ctx.cfg.model_copy(update={"team": through_program(ctx.cfg.team, program)})
        team, workload = team_shape(cfg), make_workload(cfg.workload, cfg.team)
    if problems is None:
        problems = workload.problems("heldout", ctx.cfg.workload.heldout_size, seed=ctx.cfg.seed)
    with ctx.lock:
        engines = {a: ctx.engine(a, versions[a] if versions is not None else weights_version(ctx, a, iteration))
                   for a in ctx.meg.agent_names}
        res = evaluate_team(team, workload, engines, problems, seed=ctx.cfg.seed, batch=ctx.cfg.train.eval_batch)
    return {"iteration": iteration, "heldout_accuracy": res["accuracy"], "heldout_n": res["n"],
            **{f"heldout_reward/{a}": v for a, v in res["reward"].items()}}
