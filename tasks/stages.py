"""Thin Prefect tasks, one per stage of the iteration graph; each wraps one core call.

Tasks pass ids and paths, never models: models and trainer states stay in the worker process
(`flexmarl_core.worker`). Every stage is idempotent (the MEG Store dedupes by sample id and
policy version; train/step/sync check the trainer's version), so a retry cannot duplicate work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl_core import stages
from flexmarl_core.orchestrator import Op


def _namer(kind: str) -> Callable[..., str]:
    """Task run names read like the graph (`rollout[solver] it=3 mb=2`), built from the
    parameters in the worker; cheaper than a `with_options` copy of the task per submit."""

    def name(parameters: dict[str, Any]) -> str:
        return Op(parameters["iteration"], kind, parameters["agent"], parameters["turn"],
                  parameters["mb"]).name  # type: ignore[arg-type]

    return name


def _common(kind: str) -> dict[str, Any]:
    # Results are small dicts the orchestrator reads; persisting them costs an API write each.
    return {"cache_policy": NO_CACHE, "persist_result": False, "task_run_name": _namer(kind)}


@task(name="rollout", **_common("rollout"), retries=2, retry_delay_seconds=1)
def rollout(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: generate one micro-batch for one agent node and write it to the store."""
    return stages.rollout(run_dir, iteration, agent, turn, mb)


@task(name="reward", **_common("reward"), retries=2, retry_delay_seconds=1)
def reward(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU: score one micro-batch of trajectories and append rewards/advantages to the store."""
    return stages.reward(run_dir, iteration, mb)


@task(name="train", **_common("train"), retries=1, retry_delay_seconds=1)
def train(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: forward+backward one micro-batch into the agent's accumulated gradients."""
    return stages.train(run_dir, iteration, agent, mb)


@task(name="step", **_common("step"), retries=1, retry_delay_seconds=1)
def step(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: the agent's optimizer step once its global batch is in."""
    return stages.step(run_dir, iteration, agent)


@task(name="sync", **_common("sync"), retries=2, retry_delay_seconds=1)
def sync(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """IO: publish the agent's new weights to its rollout instances."""
    return stages.sync(run_dir, iteration, agent)


BY_KIND = {"rollout": rollout, "reward": reward, "train": train, "step": step, "sync": sync}
