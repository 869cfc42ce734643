"""Weight sync: publish the agent's new weights to its rollout instances."""

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
        path = publish_weights(ctx.run_dir, agent, tr.version, state)
        eng = ctx.engines.get(agent)
        if eng is not None:  # an instance in this process takes the weights from memory
            eng.update_weights(state, tr.version)
    return StageResult(op, version=tr.version, bytes=path.stat().st_size)
