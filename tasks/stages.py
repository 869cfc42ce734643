"""Thin Prefect tasks, one per stage of the iteration graph; each wraps one core call.

Tasks pass ids and paths, never models: models and trainer states stay in the worker process
(`flexmarl_core.worker`). Every stage is idempotent (the MEG Store dedupes by sample id and
policy version; train/step/sync check the trainer's version), so a retry cannot duplicate work.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl_core import stages

# Results are small dicts the orchestrator reads; persisting them would cost an API write each.
_COMMON: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}


@task(name="rollout", retries=2, retry_delay_seconds=1, **_COMMON)
def rollout(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: generate one micro-batch for one agent node and write it to the store."""
    return stages.rollout(run_dir, iteration, agent, turn, mb)


@task(name="reward", retries=2, retry_delay_seconds=1, **_COMMON)
def reward(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU: score one micro-batch of trajectories and append rewards/advantages to the store."""
    return stages.reward(run_dir, iteration, mb)


@task(name="train", retries=1, retry_delay_seconds=1, **_COMMON)
def train(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: forward+backward one micro-batch into the agent's accumulated gradients."""
    return stages.train(run_dir, iteration, agent, mb)


@task(name="step", retries=1, retry_delay_seconds=1, **_COMMON)
def step(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: the agent's optimizer step once its global batch is in."""
    return stages.step(run_dir, iteration, agent)


@task(name="sync", retries=2, retry_delay_seconds=1, **_COMMON)
def sync(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """IO: publish the agent's new weights to its rollout instances."""
    return stages.sync(run_dir, iteration, agent)


BY_KIND = {"rollout": rollout, "reward": reward, "train": train, "step": step, "sync": sync}
