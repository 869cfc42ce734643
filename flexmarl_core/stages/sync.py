"""Weight sync: publish the agent's new weights to its rollout instances (a file when a
checkpoint is due or other processes roll out, `WorkerContext.checkpoint_due`)."""

from __future__ import annotations

from flexmarl_core.ops import Op, StageResult
from flexmarl_core.stages.registry import ConsistencyError, stage
from flexmarl_core.worker import WorkerContext, publish_weights


@stage("sync")
def sync(ctx: WorkerContext, op: Op) -> StageResult:
    agent, it = op.agent, op.iteration
    tr, _ = ctx.trainer(agent, it + 1)
    if tr.version != it + 1:
        raise ConsistencyError(f"{op.name}: trainer is at version {tr.version}, expected {it + 1}")
    with ctx.lock:
        state = tr.weights()
        # Between checkpoints of a one-process run nobody reads the file: the instance here
        # takes the weights from memory (and a restarted one from the replayed trainer).
        nbytes = 0
        if ctx.checkpoint_due(tr.version):
            nbytes = publish_weights(ctx.run_dir, agent, tr.version, state).stat().st_size
        eng = ctx.engines.get(agent)
        if eng is not None:  # an instance in this process takes the weights from memory
            eng.update_weights(state, tr.version)
    return StageResult(op, version=tr.version, bytes=nbytes)
