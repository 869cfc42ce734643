"""A critic's ops (`flexmarl_core/critic.py`): `value` here; its train, step and sync go
through the agents' stages (`train.py`, `sync.py`), which hand a critic's op to `critic_train`.
"""

from __future__ import annotations

from flexmarl_core.critic_updates import accumulate, compute_values, valued
from flexmarl_core.ops import ConsistencyError, Op, StageResult
from flexmarl_core.stages.registry import stage
from flexmarl_core.training.critic import CriticTrainer
from flexmarl_core.worker import WorkerContext


def _trainer(ctx: WorkerContext, critic: str, it: int) -> tuple[CriticTrainer, dict[str, float]]:
    with ctx.lock:
        tr, swap = ctx.trainer(critic, it)
    if not isinstance(tr, CriticTrainer):
        raise TypeError(f"{critic!r}: expected a critic's trainer, got {type(tr).__name__}")
    return tr, swap


@stage("value")
def value(ctx: WorkerContext, op: Op) -> StageResult:
    """The critic at version `it` values the micro-batch's calls of its agents (the values the
    advantages of iteration `it` use). A retry after the critic stepped finds them stored."""
    critic, it, mb = op.agent, op.iteration, op.mb
    tr, swap = _trainer(ctx, critic, it)
    if tr.version != it:
        if valued(ctx, critic, it, mb):  # a rerun after the critic stepped (resume): done
            return StageResult(op, skipped=True, swap=swap)
        raise ConsistencyError(f"{op.name}: the critic is at version {tr.version}, expected {it}, and "
                               "the micro-batch has no values (its step ran before it was valued)")
    with ctx.lock:
        n = compute_values(ctx, critic, tr, it, mb)
    return StageResult(op, samples=n, version=it, swap=swap)


def critic_train(ctx: WorkerContext, op: Op) -> StageResult:
    """Backward of the critic's value loss on one micro-batch (GAE returns from the stored
    values and rewards) into its accumulated gradients."""
    critic, it, mb = op.agent, op.iteration, op.mb
    tr, swap = _trainer(ctx, critic, it)
    done = ctx.accumulated.setdefault(critic, set())
    if tr.version != it or (it, mb) in done:
        return StageResult(op, skipped=True, swap=swap)  # a retry after the work was done
    with ctx.lock:
        metrics, n = accumulate(ctx, critic, tr, it, mb)
        done.add((it, mb))
    return StageResult(op, samples=n, tokens=n, swap=swap, metrics=metrics)
