"""The evaluation flow: greedy held-out accuracy of a finished run's team, as a Prefect artifact.

    prefect deployment run 'flexmarl-evaluate/evaluate' --param run_dir=runs/arith-team --watch
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flexmarl_core.driver.evaluate import evaluation_iteration
from tasks import report as report_tasks


@flow(name="flexmarl-evaluate")
def evaluate(run_dir: str, iteration: int | None = None) -> dict[str, Any]:
    """Evaluate the weights of `iteration` (default: the final one) of the run in `run_dir`."""
    cfg, it = evaluation_iteration(run_dir, iteration)  # fails before loading any model
    result = report_tasks.evaluate(run_dir, it)
    report_tasks.evaluation_report(cfg.name, run_dir, result)
    get_run_logger().info("%s iteration %d: held-out accuracy %.3f on %d problems",
                          cfg.name, it, result["heldout_accuracy"], result["heldout_n"])
    return result
