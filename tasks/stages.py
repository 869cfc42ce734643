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
from flexmarl_core.orchestrator import Op


class _Namer:
    """Task run names read like the graph (`rollout[solver] it=3 mb=2`), built from the
    parameters in the worker; cheaper than a `with_options` copy of the task per submit. A
    class, not a closure, so it pickles by reference (see below)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, parameters: dict[str, Any]) -> str:
        return Op(parameters["iteration"], self.kind, parameters["agent"], parameters["turn"],  # type: ignore[arg-type]
                  parameters["mb"]).name


# The tasks wrap module-level functions with their own names (`_rollout`, ...) so Dask pickles
# them by reference: a decorated function whose module attribute is the Task object is
# pickled by value with every submission (cloudpickle walks its globals; measured as the
# flow process's largest per-submit cost).


def _common(kind: str) -> dict[str, Any]:
    # Results are small dicts the orchestrator reads; persisting them costs an API write each.
    return {"cache_policy": NO_CACHE, "persist_result": False, "task_run_name": _Namer(kind)}


def _rollout(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: generate one micro-batch for one agent node and write it to the store."""
    return stages.rollout(run_dir, iteration, agent, turn, mb)


rollout = task(name="rollout", **_common("rollout"), retries=2, retry_delay_seconds=1)(_rollout)


def _reward(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU: score one micro-batch of trajectories and append rewards/advantages to the store."""
    return stages.reward(run_dir, iteration, mb)


reward = task(name="reward", **_common("reward"), retries=2, retry_delay_seconds=1)(_reward)


def _train(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: forward+backward one micro-batch into the agent's accumulated gradients."""
    return stages.train(run_dir, iteration, agent, mb)


train = task(name="train", **_common("train"), retries=1, retry_delay_seconds=1)(_train)


def _step(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """CPU/GPU: the agent's optimizer step once its global batch is in."""
    return stages.step(run_dir, iteration, agent)


step = task(name="step", **_common("step"), retries=1, retry_delay_seconds=1)(_step)


def _sync(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    """IO: publish the agent's new weights to its rollout instances."""
    return stages.sync(run_dir, iteration, agent)


sync = task(name="sync", **_common("sync"), retries=2, retry_delay_seconds=1)(_sync)


BY_KIND = {"rollout": rollout, "reward": reward, "train": train, "step": step, "sync": sync}
