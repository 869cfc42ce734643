"""Training: a trainer's micro-batch backward (`train`, or `train_gradient` as a gradient
helper) and its optimizer step (`step`), on this worker's trainer, whatever its kind
(`trainers/kinds.py`: an agent's policy, a critic)."""

from __future__ import annotations

from flexmarl_core.ops import Op, StageResult, agent_key
from flexmarl_core.runfiles.location import trainer_key
from flexmarl_core.runtime.worker import WorkerContext
from flexmarl_core.stages.registry import stage
from flexmarl_core.trainers import policy


@stage("train")
def train(ctx: WorkerContext, op: Op) -> StageResult:
    """Forward + backward of one micro-batch into the trainer's accumulated gradients."""
    return ctx.kind(op.agent).train(ctx, op)


@stage("train", gradient_only=True)
def train_gradient(ctx: WorkerContext, op: Op) -> StageResult:
    """A policy's train op away from its trainer (`codesign.gradient_helpers`)."""
    return policy.train_gradient(ctx, op)


@stage("step")
def step(ctx: WorkerContext, op: Op) -> StageResult:
    """The optimizer step once the trainer's global batch is in; checkpoints the new state
    when one is due (`WorkerContext.checkpoint_due`)."""
    agent, it = op.agent, op.iteration
    if ctx.loc.exists(trainer_key(agent, it + 1)):
        # An earlier attempt stepped and checkpointed (then died or was retried): take that state.
        with ctx.lock:
            tr, _ = ctx.trainer(agent, it + 1)
        return StageResult(op, version=tr.version, skipped=True)
    with ctx.lock:
        tr, _ = ctx.trainer(agent, it)
    if tr.version == it + 1:
        # An earlier attempt stepped but failed to checkpoint: checkpoint, never step twice.
        with ctx.lock:
            swap = ctx.checkpoint_trainer(agent) if ctx.checkpoint_due(tr.version) else {}
        return StageResult(op, version=tr.version, skipped=True, swap=swap)
    with ctx.lock:
        done = ctx.kind(agent).step(ctx, agent, tr, it)
        swap = ctx.checkpoint_trainer(agent) if ctx.checkpoint_due(tr.version) else {}
    return StageResult(op, version=tr.version, swap=swap, metrics={
        **done.metrics,
        agent_key(agent, "train/grad_norm"): done.grad_norm,
        agent_key(agent, "recomputed_mbs"): float(len(done.missing)),
        agent_key(agent, "helper_mbs"): float(len(done.helped)),
    })
