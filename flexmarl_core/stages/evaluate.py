"""Held-out evaluation of the team (not an op of the iteration graph: flows call it)."""

from __future__ import annotations

from typing import Any

from flexmarl_core.driver.evaluate import evaluate_team
from flexmarl_core.runtime.worker import context
from flexmarl_core.stages.registry import weights_version


def evaluate(run_dir: str, iteration: int) -> dict[str, Any]:
    """Greedy held-out accuracy of the team with the weights that iteration `iteration` uses
    (`iteration = train.iterations` evaluates the final weights)."""
    ctx = context(run_dir)
    problems = ctx.workload.problems("heldout", ctx.cfg.workload.heldout_size, seed=ctx.cfg.seed)
    with ctx.lock:
        engines = {a: ctx.engine(a, weights_version(ctx, a, iteration)) for a in ctx.meg.agent_names}
        res = evaluate_team(ctx.team, ctx.workload, engines, problems, seed=ctx.cfg.seed,
                           batch=ctx.cfg.train.eval_batch)
    return {"iteration": iteration, "heldout_accuracy": res["accuracy"], "heldout_n": res["n"],
            **{f"heldout_reward/{a}": v for a, v in res["reward"].items()}}
