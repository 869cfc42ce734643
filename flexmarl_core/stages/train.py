"""Training: an agent's micro-batch backward (`train`) and its optimizer step (`step`).

The loss of every micro-batch is scaled by one constant known from the config before any
rollout (`loss_scale`), so early backward of a micro-batch is exact however the batch is split
or ordered: the accumulated gradient equals the whole global batch's.
"""

from __future__ import annotations

from typing import Any

from flexmarl_core.algorithms import advantage_scope, compute_advantages
from flexmarl_core.algorithms.losses import token_weight
from flexmarl_core.location import gradient_key, trainer_key
from flexmarl_core.ops import Op, StageResult, agent_key
from flexmarl_core.stages.registry import ConsistencyError, stage
from flexmarl_core.training import Sample
from flexmarl_core.worker import WorkerContext, load_gradient, publish_gradient


def samples_per_step(ctx: WorkerContext, agent: str) -> int:
    turns = sum(1 for n in ctx.meg.nodes if n.agent == agent)
    return ctx.cfg.batch.inputs_per_iteration * ctx.cfg.batch.group_size * turns


def loss_scale(ctx: WorkerContext, agent: str) -> float:
    """1 / (samples per global batch x max new tokens): the loss is a token sum over a constant
    (Dr. GRPO's normaliser) rather than GRPO's per-sequence mean or the global token count,
    because either of those needs every rollout of the batch before the first backward. Each
    sampled token weighs the same whatever its sequence's length; a batch of short answers
    gets a proportionally smaller loss (and gradient) than one of long answers."""
    return 1.0 / (samples_per_step(ctx, agent) * ctx.cfg.agent(agent).sampling.max_new_tokens)


def check_staleness(agent: str, version: int, rows: list[dict], k: int) -> None:
    """No sample older than k versions (k = 0: every sample from exactly `version`), none from
    the future; the error names the agent, the update and the offending samples' versions."""
    if k == 0:
        bad = [r for r in rows if r["policy_version"] != version]
        if bad:
            raise ConsistencyError(
                f"agent {agent!r} update {version}: samples {[r['sample_id'] for r in bad[:3]]} were "
                f"not produced by policy version {version} (on-policy violated)"
            )
        return
    bad = [r for r in rows if not version - k <= r["policy_version"] <= version]
    if bad:
        seen = sorted({int(r["policy_version"]) for r in bad})
        raise ConsistencyError(
            f"agent {agent!r} update {version}: samples {[r['sample_id'] for r in bad[:3]]} come from "
            f"policy version(s) {seen}, outside [{version - k}, {version}] allowed by "
            f"codesign.max_staleness={k}"
        )


@stage("train")
def train(ctx: WorkerContext, op: Op) -> StageResult:
    """Forward + backward of one micro-batch into the agent's accumulated gradients."""
    agent, it, mb = op.agent, op.iteration, op.mb
    tr, swap = ctx.trainer(agent, it)
    done = ctx.accumulated.setdefault(agent, set())
    if tr.version != it or (it, mb) in done:
        # A retry after the work was done (version moved on, or this micro-batch is in the grads).
        return StageResult(op, skipped=True, swap=swap)
    rows, batch = _micro_batch(ctx, tr, op)
    with ctx.lock:
        stats, trained, skipped = _accumulate(ctx, tr, agent, batch)
        done.add((it, mb))
    _mark_consumed(ctx, agent, it, mb, rows)
    return _result(ctx, op, tr.version, rows, stats, trained, skipped, swap)


@stage("train", gradient_only=True)
def train_gradient(ctx: WorkerContext, op: Op) -> StageResult:
    """A train op away from its agent's trainer (`codesign.gradient_helpers`): this process's
    copy of the agent's weights of the op's iteration (`WorkerContext.helper`) computes the
    micro-batch's gradient, which goes to the run's location for the agent's step to add
    (`_step`): the gradient `train` would have accumulated, summed in another order."""
    agent, it, mb = op.agent, op.iteration, op.mb
    key = gradient_key(agent, it, mb)
    if ctx.loc.exists(trainer_key(agent, it + 1)) or ctx.loc.is_file(key):
        return StageResult(op, skipped=True)  # a retry after the work was done
    with ctx.lock:
        h = ctx.helper(agent, it)
        rows, batch = _micro_batch(ctx, h, op)
        try:
            stats, trained, skipped = _accumulate(ctx, h, agent, batch)
        finally:
            grad = h.take_grads()  # also after a failure: the next op starts from zero
    _mark_consumed(ctx, agent, it, mb, rows)
    publish_gradient(ctx.loc, agent, it, mb, grad)  # last: its presence means done
    res = _result(ctx, op, it, rows, stats, trained, skipped, {})
    res.metrics[agent_key(agent, "train/helper_bytes")] = float(grad.numel() * grad.element_size())
    return res


def _result(ctx: WorkerContext, op: Op, version: int, rows: list[tuple[dict[str, Any], float]],
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


def _accumulate(ctx: WorkerContext, tr: Any, agent: str,
                batch: list[Sample]) -> tuple[dict[str, float], list[Sample], list[Sample]]:
    """Forward + backward of `batch` into `tr` (zero-advantage samples skipped where the agent
    asks for it), the same way in a train op and in a step's or a replay's recomputation, so a
    replay reproduces the run's gradients exactly. Call with `ctx.lock` held."""
    skip = ctx.cfg.agent(agent).algorithm.skip_zero_advantage
    trained, skipped = skip_zero_advantage(batch) if skip else (batch, [])
    return tr.accumulate(trained, loss_scale=loss_scale(ctx, agent)), trained, skipped

def _micro_batch(ctx: WorkerContext, tr: Any, op: Op) -> tuple[list[tuple[dict[str, Any], float]], list[Sample]]:
    """The (row, advantage) pairs and training samples of `op`'s micro-batch, from the store."""
    agent, it, mb = op.agent, op.iteration, op.mb
    alg = ctx.cfg.agent(agent).algorithm
    # Group-scoped estimators need only this micro-batch (whole groups); batch-scoped ones
    # (REINFORCE++) normalise over the iteration, whose rewards the plan waits for.
    whole = advantage_scope(alg.advantage) == "batch"
    # Consumed-or-not does not matter here: the trainer is still at `it`, so no update has
    # applied these samples yet; a `consumed_step` on them was written by an attempt whose
    # gradients died with its process (the version check keeps this exactly-once).
    rows = ctx.store.ready(agent, it, need=("reward",), unconsumed=False, mb=None if whole else mb).to_pylist()
    per_mb = samples_per_step(ctx, agent) // ctx.cfg.batch.num_micro_batches
    expected = per_mb * (ctx.cfg.batch.num_micro_batches if whole else 1)
    if len(rows) != expected:
        raise RuntimeError(f"{op.name}: {len(rows)} samples ready, expected {expected}")
    check_staleness(agent, tr.version, rows, ctx.cfg.codesign.max_staleness)
    rows.sort(key=lambda r: r["sample_id"])
    adv = compute_advantages(
        alg.advantage, [float(r["reward"]) for r in rows], [f"{r['input_id']}:{r['turn']}" for r in rows]
    ).tolist()
    mine = [(r, a) for r, a in zip(rows, adv, strict=True) if r["mb"] == mb]
    batch = [
        Sample(prompt_ids=r["prompt_ids"], response_ids=r["response_ids"], logprobs=r["logprobs"],
               advantage=a, loss_mask=r.get("loss_mask"))
        for r, a in mine
    ]
    return mine, batch


def _mark_consumed(ctx: WorkerContext, agent: str, it: int, mb: int,
                   mine: list[tuple[dict[str, Any], float]]) -> None:
    ctx.store.write_status(agent, it, [
        {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb,
         "advantage": a, "consumed_step": it}
        for r, a in mine
    ])


def skip_zero_advantage(batch: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(samples to train, samples skipped): a sample whose advantage is exactly 0 (a GRPO group
    with all-equal rewards) adds exactly 0 to the gradient when kl_coef is 0 (the config
    enforces it), so its forward and backward are skipped. One sample is always kept, so every
    micro-batch still counts as accumulated (its gradient is then exactly 0)."""
    trained = [s for s in batch if s.advantage != 0.0]
    if not trained:
        trained = batch[:1]
    kept = {id(s) for s in trained}
    return trained, [s for s in batch if id(s) not in kept]


@stage("step")
def step(ctx: WorkerContext, op: Op) -> StageResult:
    """The agent's optimizer step once its global batch is in; checkpoints the new state when
    one is due (`WorkerContext.checkpoint_due`)."""
    agent, it = op.agent, op.iteration
    if ctx.loc.exists(trainer_key(agent, it + 1)):
        # An earlier attempt stepped and checkpointed (then died or was retried): take that state.
        tr, _ = ctx.trainer(agent, it + 1)
        return StageResult(op, version=tr.version, skipped=True)
    tr, _ = ctx.trainer(agent, it)
    if tr.version == it + 1:
        # An earlier attempt stepped but failed to checkpoint: checkpoint, never step twice.
        with ctx.lock:
            swap = ctx.checkpoint_trainer(agent) if ctx.checkpoint_due(tr.version) else {}
        return StageResult(op, version=tr.version, skipped=True, swap=swap)
    with ctx.lock:
        grad_norm, missing, helped = _step(ctx, agent, tr, it)
        swap = ctx.checkpoint_trainer(agent) if ctx.checkpoint_due(tr.version) else {}
    return StageResult(op, version=tr.version, swap=swap, metrics={
        agent_key(agent, "train/grad_norm"): grad_norm,
        agent_key(agent, "recomputed_mbs"): float(len(missing)),
        agent_key(agent, "helper_mbs"): float(len(helped)),
    })


def _step(ctx: WorkerContext, agent: str, tr: Any, it: int,
          *, replaying: bool = False) -> tuple[float, list[int], list[int]]:
    """Step `tr` from version `it`. A micro-batch whose gradient is not in it is added from its
    gradient helper's file (`train_gradient`) if there is one, else accumulated again from the
    store (it died with another process, the trainer moved, or a replay): same samples, same
    gradients. Returns the grad norm, the recomputed and the helpers' micro-batches. Call
    with `ctx.lock` held."""
    done = ctx.accumulated.setdefault(agent, set())
    num_mb = ctx.cfg.batch.num_micro_batches
    helpers = ctx.cfg.codesign.gradient_helpers
    missing, helped = [], []
    for j in (j for j in range(num_mb) if (it, j) not in done):
        grad = load_gradient(ctx.loc, agent, it, j) if helpers and not replaying else None
        if grad is not None:
            tr.add_grads(grad)
            helped.append(j)
            continue
        rows, batch = _micro_batch(ctx, tr, Op(it, "train", agent, mb=j))
        _accumulate(ctx, tr, agent, batch)
        missing.append(j)
        if not replaying:
            _mark_consumed(ctx, agent, it, j, rows)
    res = tr.step()
    done.clear()
    if helpers:
        for j in range(num_mb):  # their work is in the step now (a replay recomputes them)
            ctx.loc.delete(gradient_key(agent, it, j))
    return res.grad_norm, missing, helped


def replay(ctx: WorkerContext, agent: str, tr: Any, version: int) -> None:
    """Bring `tr` to `version` by redoing the steps since its own version from the samples in
    the store (their rewards and advantages are already there): the steps after the last
    checkpoint, after a restart. The samples stay as they are (already marked consumed)."""
    while tr.version < version:
        _step(ctx, agent, tr, tr.version, replaying=True)
