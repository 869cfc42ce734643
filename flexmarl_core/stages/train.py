"""Training: an agent's micro-batch backward (`train`, or `train_gradient` as a gradient helper)
and its optimizer step (`step`), on this worker's trainer; the update itself is `updates.py`.
"""

from __future__ import annotations

from flexmarl_core.algorithms.losses import token_weight
from flexmarl_core.critic import is_critic
from flexmarl_core.location import gradient_key, trainer_key
from flexmarl_core.ops import ConsistencyError, Op, StageResult, agent_key
from flexmarl_core.stages.critic import critic_train
from flexmarl_core.stages.registry import stage
from flexmarl_core.training import Sample
from flexmarl_core.updates import (
    Rows,
    accumulate,
    check_staleness,
    loss_scale,
    mark_consumed,
    micro_batch,
    skip_zero_advantage,
    step_trainer,
)
from flexmarl_core.weights import publish_gradient
from flexmarl_core.worker import WorkerContext

# re-exported: what tests and callers of the stage modules import from here
__all__ = ["ConsistencyError", "check_staleness", "loss_scale", "skip_zero_advantage", "step", "train",
           "train_gradient"]


@stage("train")
def train(ctx: WorkerContext, op: Op) -> StageResult:
    """Forward + backward of one micro-batch into the agent's accumulated gradients."""
    agent, it, mb = op.agent, op.iteration, op.mb
    if is_critic(ctx.cfg, agent):
        return critic_train(ctx, op)
    # Under the lock: a new trainer (or a swapped-in one) changes which adapter of a shared
    # LoRA base is trainable, which a rollout on another thread of this process also sets.
    with ctx.lock:
        tr, swap = ctx.trainer(agent, it)
    done = ctx.accumulated.setdefault(agent, set())
    if tr.version != it or (it, mb) in done:
        # A retry after the work was done (version moved on, or this micro-batch is in the grads).
        return StageResult(op, skipped=True, swap=swap)
    rows, batch = micro_batch(ctx, tr, op)
    with ctx.lock:
        stats, trained, skipped = accumulate(ctx, tr, agent, batch)
        done.add((it, mb))
    mark_consumed(ctx, agent, it, mb, rows)
    return _result(ctx, op, tr.version, rows, stats, trained, skipped, swap)


@stage("train", gradient_only=True)
def train_gradient(ctx: WorkerContext, op: Op) -> StageResult:
    """A train op away from its agent's trainer (`codesign.gradient_helpers`): this process's
    copy of the agent's weights of the op's iteration (`WorkerContext.helper`) computes the
    micro-batch's gradient, which goes to the run's location for the agent's step to add
    (`updates.step_trainer`): the gradient `train` would have accumulated, summed in another order."""
    agent, it, mb = op.agent, op.iteration, op.mb
    key = gradient_key(agent, it, mb)
    if ctx.loc.exists(trainer_key(agent, it + 1)) or ctx.loc.is_file(key):
        return StageResult(op, skipped=True)  # a retry after the work was done
    with ctx.lock:
        h = ctx.helper(agent, it)
        rows, batch = micro_batch(ctx, h, op)
        try:
            stats, trained, skipped = accumulate(ctx, h, agent, batch)
        finally:
            grad = h.take_grads()  # also after a failure: the next op starts from zero
    mark_consumed(ctx, agent, it, mb, rows)
    publish_gradient(ctx.loc, agent, it, mb, grad)  # last: its presence means done
    res = _result(ctx, op, it, rows, stats, trained, skipped, {})
    res.metrics[agent_key(agent, "train/helper_bytes")] = float(grad.numel() * grad.element_size())
    return res


def _result(ctx: WorkerContext, op: Op, version: int, rows: Rows,
            stats: dict[str, float], trained: list[Sample], skipped: list[Sample],
            swap: dict[str, float]) -> StageResult:
    agent = op.agent
    tokens = int(token_weight(trained))
    # The trainer's figures are token sums times the loss scale: report per-token means of
    # this micro-batch (an iteration's figure is their token-weighted mean, metrics.py).
    per_token = 1.0 / (loss_scale(ctx, agent) * max(tokens, 1))
    metrics = {agent_key(agent, f"train/{k}"): float(v) * per_token for k, v in stats.items()}
    if ctx.cfg.agent(agent).algorithm.skip_zero_advantage:
        metrics[agent_key(agent, "train/skipped_samples")] = float(len(skipped))
        metrics[agent_key(agent, "train/skipped_tokens")] = float(sum(
            len(s.prompt_ids) + len(s.response_ids) for s in skipped))
    if ctx.cfg.codesign.max_staleness:
        lag = [version - r["policy_version"] for r, _ in rows]  # versions behind the update
        metrics[agent_key(agent, "staleness")] = sum(lag) / max(len(lag), 1)
    return StageResult(op, samples=len(trained), tokens=tokens, swap=swap, metrics=metrics)


@stage("step")
def step(ctx: WorkerContext, op: Op) -> StageResult:
    """The agent's optimizer step once its global batch is in; checkpoints the new state when
    one is due (`WorkerContext.checkpoint_due`)."""
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
        done = step_trainer(ctx, agent, tr, it)
        swap = ctx.checkpoint_trainer(agent) if ctx.checkpoint_due(tr.version) else {}
    return StageResult(op, version=tr.version, swap=swap, metrics={
        **done.metrics,
        agent_key(agent, "train/grad_norm"): done.grad_norm,
        agent_key(agent, "recomputed_mbs"): float(len(done.missing)),
        agent_key(agent, "helper_mbs"): float(len(done.helped)),
    })
