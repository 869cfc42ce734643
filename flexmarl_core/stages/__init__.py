"""The work of each node of the iteration graph, run inside a worker process.

Every stage is `fn(ctx, op) -> StageResult` (registered by op kind in `registry.STAGES`): it
reads what it needs from the MEG Store, works with the engines and trainers kept in this
process (`worker.context`) and returns its measurements. Every stage is idempotent: a retry
rewrites the same store rows (deduplicated by sample id and policy version) or finds the work
already done.
"""

from flexmarl_core.runtime.worker import context
from flexmarl_core.stages import episode, program, reward, rollout, sync, train, value  # noqa: F401  (registers the stages)
from flexmarl_core.stages.evaluate import evaluate
from flexmarl_core.stages.faults import InjectedFault, faults_dir
from flexmarl_core.stages.registry import (
    STAGES,
    ConsistencyError,
    run_fused,
    run_stage,
    run_stage_after,
    run_stage_retrying,
    stage,
    stage_seed,
    weights_version,
)
from flexmarl_core.trainers.policy import loss_scale

__all__ = [
    "STAGES", "ConsistencyError", "InjectedFault", "context", "evaluate", "faults_dir",
    "loss_scale", "run_fused", "run_stage", "run_stage_after", "run_stage_retrying", "stage", "stage_seed", "weights_version",
]
