"""Weight sync: publish the agent's new weights to its rollout instances (a file when a
checkpoint is due or other processes roll out, `WorkerContext.checkpoint_due`)."""

from __future__ import annotations

from flexmarl_core.ops import ConsistencyError, Op, StageResult, agent_key
from flexmarl_core.runfiles.location import weights_key
from flexmarl_core.runfiles.weights import publish_weights
from flexmarl_core.runtime.worker import WorkerContext
from flexmarl_core.stages.faults import fault_point
from flexmarl_core.stages.registry import stage


@stage("sync")
def sync(ctx: WorkerContext, op: Op) -> StageResult:
    """Publish the new version at the run's location (what a restarted or new worker reads),
    hand it to an engine of this process in memory, and, for a run on object storage, push it
    to the other processes' engines of the agent through this worker's transport (on Dask a
    broadcast, `cluster.DaskWeightPushes`) instead of each of them reading the object."""
    agent, it = op.agent, op.iteration
    with ctx.lock:  # as in the train stage: a trainer may be made or swapped in here
        tr, _ = ctx.trainer(agent, it + 1)
    if tr.version != it + 1:
        raise ConsistencyError(f"{op.name}: trainer is at version {tr.version}, expected {it + 1}")
    with ctx.lock:
        # The trainer's own tensors: the file and the engine here copy them before anything
        # steps again (the lock), so a sync holds no copy of the weights of its own.
        state = tr.weights(copy=False)
        # Between checkpoints of a one-process run nobody reads the file: the instance here
        # takes the weights from memory (and a restarted one from the replayed trainer).
        blob, nbytes = None, 0
        if ctx.checkpoint_due(tr.version):
            blob = publish_weights(ctx.loc, agent, tr.version, state)
            nbytes = len(blob) if blob is not None else ctx.loc.size(weights_key(agent, tr.version))
            # where a test stops the run between a new version's write and the run's deletes
            fault_point(ctx.loc.uri, f"{op.name} published")
        else:  # no file: a stale rollout after the next step asks this process for it
            ctx.keep_unpublished(agent, tr.version, state)
        eng = ctx.engines.get(agent)
        if eng is not None:  # an instance in this process takes the weights from memory
            eng.update_weights(state, tr.version)
        del state
    push: dict[str, float] = {}
    # Only for a remote location: a file on local disk (page cache) reads in milliseconds, less
    # than a broadcast costs the sync.
    if blob and ctx.kind(agent).serves_instances:
        push = ctx.transport.push(ctx.loc.uri, agent, tr.version, blob)
    return StageResult(op, version=tr.version, bytes=nbytes,
                       metrics={agent_key(agent, f"sync/{k}"): v for k, v in push.items()})
