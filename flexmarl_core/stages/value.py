"""A critic's `value` op (`trainers/critic.py`): its train, step and sync go through the
trainers' stages (`train.py`, `sync.py`) like an agent's."""

from __future__ import annotations

from flexmarl_core.ops import Op, StageResult
from flexmarl_core.runtime.worker import WorkerContext
from flexmarl_core.stages.registry import stage
from flexmarl_core.trainers import critic


@stage("value")
def value(ctx: WorkerContext, op: Op) -> StageResult:
    """The critic at version `it` values the micro-batch's calls of its agents."""
    return critic.value(ctx, op)
