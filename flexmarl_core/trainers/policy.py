"""The policy trainer kind: an agent's update from the MEG Store's samples (its micro-batches,
their backward, the optimizer step), the same way in its ops and in a replay after a restart.

The train and step stages (`stages/train.py`) call `PolicyKind` on the worker's trainer; the
worker's context steps it again (`replaying`) to bring a trainer from its last checkpoint to a
later version. Both compute a micro-batch the same way, so a replay reproduces the run's
gradients exactly.

The loss of every micro-batch is scaled by one constant known from the config before any
rollout (`loss_scale`), so early backward of a micro-batch is exact however the batch is split
or ordered: the accumulated gradient equals the whole global batch's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flexmarl_core.algorithms import advantage_scope
from flexmarl_core.algorithms.losses import token_weight
from flexmarl_core.inference.api import synced_now
from flexmarl_core.models.lora import SharedBase, base_key
from flexmarl_core.ops import ConsistencyError, Op, StageResult, agent_key
from flexmarl_core.runfiles.location import gradient_key, trainer_key
from flexmarl_core.runfiles.weights import load_gradient, load_weights, publish_gradient
from flexmarl_core.trainers.kinds import AuditCheck, Stepped, register_trainer_kind
from flexmarl_core.trainers.scopes import estimator_scope
from flexmarl_core.training import make_trainer
from flexmarl_core.training.api import GradientTrainer, Sample, TrainBackend
from flexmarl_core.training.factory import make_lora_trainer

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.runtime.view import WorkerView

#: A micro-batch's store rows (each with its advantage), as read for training.
Rows = list[tuple[dict[str, Any], float]]


def samples_per_step(ctx: WorkerView, agent: str) -> int:
    turns = sum(1 for n in ctx.meg.nodes if n.agent == agent)
    return ctx.cfg.batch.inputs_per_iteration * ctx.cfg.batch.group_size * turns


def loss_scale(ctx: WorkerView, agent: str) -> float:
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
    # A partial rollout's tokens span versions: its policy_version is the oldest, the newest
    # is its last token's (`token_versions`); both must lie in the window.
    bad = [r for r in rows if not version - k <= r["policy_version"] <= _newest(r) <= version]
    if bad:
        seen = sorted({int(r["policy_version"]) for r in bad} | {_newest(r) for r in bad})
        raise ConsistencyError(
            f"agent {agent!r} update {version}: samples {[r['sample_id'] for r in bad[:3]]} come from "
            f"policy version(s) {seen}, outside [{version - k}, {version}] allowed by "
            f"codesign.max_staleness={k}"
        )


def _newest(row: dict) -> int:
    tv = row.get("token_versions")
    return int(max(tv)) if tv else int(row["policy_version"])


def skip_zero_advantage(batch: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(samples to train, samples skipped): a sample whose advantage is exactly 0 (a GRPO group
    with all-equal rewards) adds exactly 0 to the gradient when kl_coef is 0 (the config
    enforces it), so its forward and backward are skipped. One sample is always kept, so every
    micro-batch still counts as accumulated (its gradient is then exactly 0)."""
    trained = [s for s in batch if s.advantage != 0.0 or any(s.token_advantages or ())]
    if not trained:
        trained = batch[:1]
    kept = {id(s) for s in trained}
    return trained, [s for s in batch if id(s) not in kept]


def accumulate(ctx: WorkerView, tr: TrainBackend, agent: str,
               batch: list[Sample]) -> tuple[dict[str, float], list[Sample], list[Sample]]:
    """Forward + backward of `batch` into `tr` (zero-advantage samples skipped where the agent
    asks for it), the same way in a train op and in a step's or a replay's recomputation, so a
    replay reproduces the run's gradients exactly. Call with `ctx.lock` held."""
    skip = ctx.cfg.agent(agent).algorithm.skip_zero_advantage
    trained, skipped = skip_zero_advantage(batch) if skip else (batch, [])
    device = getattr(tr, "device", None)
    t0 = synced_now(device)
    stats = tr.accumulate(trained, loss_scale=loss_scale(ctx, agent))
    # the forward and backward's own seconds (collate and the reference's forward included)
    return {**stats, "fwd_bwd_s": synced_now(device) - t0}, trained, skipped


def micro_batch(ctx: WorkerView, tr: TrainBackend, op: Op,
                version: int | None = None) -> tuple[Rows, list[Sample]]:
    """The (row, advantage) pairs and training samples of `op`'s micro-batch, from the store,
    checked against the update of `version` (default: the trainer's)."""
    agent, it, mb = op.agent, op.iteration, op.mb
    estimator = ctx.cfg.agent(agent).algorithm.advantage
    read = estimator_scope(advantage_scope(estimator)).read(ctx, agent, estimator, it, mb)
    ids = ctx.team.expected_ids(ctx, it, read.mbs, agent)
    rows = [r for r in read.rows if r["sample_id"] in ids]
    if len(rows) != len(ids):  # the plan let this op start before its samples were in
        missing = sorted(ids - {r["sample_id"] for r in rows})
        raise RuntimeError(f"{op.name}: {len(missing)} of {len(ids)} samples not ready, e.g. {missing[:3]}")
    check_staleness(agent, tr.version if version is None else version, rows, ctx.cfg.codesign.max_staleness)
    rows.sort(key=lambda r: r["sample_id"])
    adv, per_token = read.advantages(rows)
    mine = [(r, a, t) for r, a, t in zip(rows, adv, per_token, strict=True) if r["mb"] == mb]
    batch = [
        Sample(prompt_ids=r["prompt_ids"], response_ids=r["response_ids"], logprobs=r["logprobs"],
               advantage=a, loss_mask=r.get("loss_mask"), token_advantages=t)
        for r, a, t in mine
    ]
    return [(r, a) for r, a, _ in mine], batch


def mark_consumed(ctx: WorkerView, agent: str, it: int, mb: int, mine: Rows) -> None:
    """Status rows: these samples trained the update of iteration `it` (with their advantage)."""
    ctx.store.mark_consumed(
        agent, it, [{"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb} for r, _ in mine],
        step=it, advantages=[a for _, a in mine])




def train_gradient(ctx: WorkerView, op: Op) -> StageResult:
    """A train op away from its agent's trainer (`codesign.gradient_helpers`): this process's
    copy of the agent's weights of the op's iteration (`WorkerView.helper`) computes the
    micro-batch's gradient, which goes to the run's location for the agent's step to add: the
    gradient `PolicyKind.train` would have accumulated, summed in another order."""
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


def _result(ctx: WorkerView, op: Op, version: int, rows: Rows,
            stats: dict[str, float], trained: list[Sample], skipped: list[Sample],
            swap: dict[str, float]) -> StageResult:
    agent = op.agent
    tokens = int(token_weight(trained))
    # The trainer's figures are token sums times the loss scale: report per-token means of
    # this micro-batch (an iteration's figure is their token-weighted mean, driver/metrics.py).
    per_token = 1.0 / (loss_scale(ctx, agent) * max(tokens, 1))
    counts = {k: stats[k] for k in ("tokens_padded", "tokens_cells", "tokens_shared", "tokens_sample", "fwd_bwd_s") if k in stats}  # not loss terms
    metrics = {agent_key(agent, f"train/{k}"): float(v) * per_token for k, v in stats.items() if k not in counts}
    metrics.update({agent_key(agent, f"train/{k}"): float(v) for k, v in counts.items()})
    if ctx.cfg.agent(agent).algorithm.skip_zero_advantage:
        metrics[agent_key(agent, "train/skipped_samples")] = float(len(skipped))
        metrics[agent_key(agent, "train/skipped_tokens")] = float(sum(
            len(s.prompt_ids) + len(s.response_ids) for s in skipped))
    if ctx.cfg.codesign.max_staleness:
        lag = [version - r["policy_version"] for r, _ in rows]  # versions behind the update
        metrics[agent_key(agent, "staleness")] = sum(lag) / max(len(lag), 1)
    return StageResult(op, samples=len(trained), tokens=tokens, swap=swap, metrics=metrics)


@register_trainer_kind("policy")
class PolicyKind:
    """A trainable agent's policy: trained by the policy loss on its own samples' advantages."""

    serves_instances = True

    def audited(self, cfg: ExperimentConfig, agent: str) -> dict[str, list[AuditCheck]]:
        return {agent: [AuditCheck("consumed_step", "unconsumed", "were never trained on")]}

    def new_trainer(self, ctx: WorkerView, agent: str) -> TrainBackend:
        """LoRA agents on one base share this process's copy of it."""
        acfg = ctx.cfg.agent(agent)
        if acfg.model.lora is None:
            model, _ = ctx.fresh_model(agent)
            model.load_state_dict(load_weights(ctx.loc, agent, 0))
            return make_trainer(acfg, model)
        key = base_key(acfg.model, ctx.cfg.seed)
        shared = ctx.shared_train_bases.get(key)
        if shared is None:
            model, _ = ctx.fresh_model(agent)
            shared = ctx.shared_train_bases[key] = SharedBase(model)
        shared.add(agent, acfg.model.lora)
        shared.load_adapter_state(agent, load_weights(ctx.loc, agent, 0))
        return make_lora_trainer(acfg, shared)

    def train(self, ctx: WorkerView, op: Op) -> StageResult:
        """Forward + backward of one micro-batch into the agent's accumulated gradients."""
        agent, it, mb = op.agent, op.iteration, op.mb
        # Under the lock: a new trainer (or a swapped-in one) changes which adapter of a shared
        # LoRA base is trainable, which a rollout on another thread of this process also sets.
        with ctx.lock:
            tr, swap = ctx.trainer(agent, it)
        done = ctx.accumulated.setdefault(agent, set())
        if tr.version != it or (it, mb) in done:
            # A retry after the work was done (version moved on, or this micro-batch is in the grads).
            if tr.version > it and ctx.store.ready(agent, it, mb=mb, columns=["sample_id"]).num_rows:
                # stepped, but some of its status rows are gone (a repaired store): write them back
                mark_consumed(ctx, agent, it, mb, micro_batch(ctx, tr, op, version=it)[0])
            return StageResult(op, skipped=True, swap=swap)
        rows, batch = micro_batch(ctx, tr, op)
        with ctx.lock:
            stats, trained, skipped = accumulate(ctx, tr, agent, batch)
            done.add((it, mb))
        mark_consumed(ctx, agent, it, mb, rows)
        return _result(ctx, op, tr.version, rows, stats, trained, skipped, swap)

    def step(self, ctx: WorkerView, agent: str, tr: TrainBackend, it: int, *,
             replaying: bool = False) -> Stepped:
        """A micro-batch whose gradient is not in `tr` is added from its gradient helper's file
        (`train_gradient`) if there is one, else accumulated again from the store (it died with
        another process, the trainer moved, or a replay): same samples, same gradients."""
        done = ctx.accumulated.setdefault(agent, set())
        num_mb = ctx.cfg.batch.num_micro_batches
        helpers = ctx.cfg.codesign.gradient_helpers
        missing, helped = [], []
        for j in (j for j in range(num_mb) if (it, j) not in done):
            grad = load_gradient(ctx.loc, agent, it, j) if helpers and not replaying else None
            if grad is not None:
                if not isinstance(tr, GradientTrainer):
                    raise TypeError(f"agent {agent!r}: a helper's gradient for a trainer that cannot add "
                                    f"one ({type(tr).__name__})")
                tr.add_grads(grad)
                helped.append(j)
                continue
            rows, batch = micro_batch(ctx, tr, Op(it, "train", agent, mb=j))
            accumulate(ctx, tr, agent, batch)
            missing.append(j)
            if not replaying:
                mark_consumed(ctx, agent, it, j, rows)
        res = tr.step()
        done.clear()
        if helpers:
            for j in range(num_mb):  # their work is in the step now (a replay recomputes them)
                ctx.loc.delete(gradient_key(agent, it, j))
        return Stepped(res.grad_norm, missing, helped, {})
