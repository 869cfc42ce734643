"""Prefect tasks generated from the stage registry: one task per op kind, each taking the run
folder and the `Op`; its task run is named by `Op.name` (`rollout[solver] it=3 mb=2`).

Tasks pass ids and paths, never models: models and trainer states stay in the worker process
(`flexmarl_core.worker`). Every stage is idempotent (the MEG Store dedupes by sample id and
policy version; train/step/sync check the trainer's version), so a retry cannot duplicate work.
Retries per kind below: rollouts and rewards are cheap to redo, a trainer op twice at most.
"""

from __future__ import annotations

from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from flexmarl_core.ops import OP_KINDS, Op, StageResult
from flexmarl_core.stages import STAGES, run_stage

#: Prefect task retries per op kind (a worker that dies is Dask's to rerun, not Prefect's)
RETRIES: dict[str, int] = {"rollout": 2, "reward": 2, "train": 1, "step": 1, "sync": 2}
#: what each kind's work is, for the task's description in the UI
WORK: dict[str, str] = {
    "rollout": "CPU/GPU: generate one micro-batch for one agent node and write it to the store.",
    "reward": "CPU: score one micro-batch of trajectories and append rewards to the store.",
    "train": "CPU/GPU: forward+backward one micro-batch into the agent's accumulated gradients.",
    "step": "CPU/GPU: the agent's optimizer step once its global batch is in.",
    "sync": "IO: publish the agent's new weights to its rollout instances.",
}


def _task_run_name(parameters: dict[str, Any]) -> str:
    return parameters["op"].name


def stage_task(run_dir: str, op: Op) -> StageResult:
    """Run one op's stage in this worker (see `flexmarl_core.stages`)."""
    return run_stage(run_dir, op)


def _make(kind: str) -> Task:
    # The task wraps the module-level `stage_task`, so Dask pickles it by reference: a
    # decorated function whose module attribute is the Task object is pickled by value with
    # every submission (cloudpickle walks its globals; measured as the flow process's largest
    # per-submit cost). Results are small objects the orchestrator reads; persisting them
    # would cost an API write each.
    t = task(stage_task, name=kind, description=WORK[kind], retries=RETRIES[kind],
             retry_delay_seconds=1, cache_policy=NO_CACHE, persist_result=False,
             task_run_name=_task_run_name)
    t.task_key = f"flexmarl-{kind}"  # one function behind every kind: keep their keys apart
    return t


if set(STAGES) != set(OP_KINDS):
    raise RuntimeError(f"stages registered for {sorted(STAGES)}, op kinds are {list(OP_KINDS)}")
BY_KIND: dict[str, Task] = {kind: _make(kind) for kind in OP_KINDS}
