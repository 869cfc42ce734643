"""Run bookkeeping tasks: prepare the run folder, publish the run's artifacts."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flexmarl_core import run, stages
from flexmarl_core.config import ExperimentConfig


@task(name="prepare-run", retries=1, cache_policy=NO_CACHE, persist_result=False)
def prepare_run(cfg: ExperimentConfig) -> str:
    """CPU/IO: run folder, initial weights per agent, every iteration's inputs in the store."""
    return str(run.prepare_run(cfg))


@task(name="evaluate", retries=1, cache_policy=NO_CACHE, persist_result=False)
def evaluate(run_dir: str, iteration: int) -> dict[str, Any]:
    """CPU: greedy held-out accuracy of the team with the weights of `iteration`."""
    return stages.evaluate(run_dir, iteration)


@task(name="report", cache_policy=NO_CACHE, persist_result=False)
def report(name: str, per_it: list[dict[str, Any]], summary: dict[str, Any], store_uri: str) -> None:
    """IO: a table artifact of the iterations and a markdown summary of the run."""
    key = "".join(c if c.isalnum() else "-" for c in name.lower())
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()} for m in per_it]
    create_table_artifact(key=f"{key}-iterations", table=rows, description=f"{name}: per-iteration metrics")
    lines = [f"# {name}", "", f"- store: `{store_uri}`", f"- run folder: `{summary.get('run_dir', '')}`"]
    lines += [f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summary.items()
              if k not in ("run_dir",)]
    create_markdown_artifact(key=f"{key}-summary", markdown="\n".join(lines), description=f"{name}: run summary")


@task(name="evaluation-report", cache_policy=NO_CACHE, persist_result=False)
def evaluation_report(name: str, run_dir: str, result: dict[str, Any]) -> None:
    """IO: a markdown artifact with a run's held-out evaluation (accuracy, reward per agent)."""
    key = "".join(c if c.isalnum() else "-" for c in name.lower())
    lines = [f"# {name}: held-out evaluation, iteration {result['iteration']}", "",
             f"- run folder: `{run_dir}`",
             f"- accuracy: {result['heldout_accuracy']:.4g} on {result['heldout_n']} problems"]
    lines += [f"- {k}: {v:.4g}" for k, v in sorted(result.items()) if k.startswith("heldout_reward/")]
    create_markdown_artifact(key=f"{key}-evaluation", markdown="\n".join(lines),
                             description=f"{name}: held-out evaluation")
