"""An agent's policy update from the MEG Store's samples: its micro-batches, their backward,
the optimizer step, and the replay of steps after a restart.

The train stages (`stages/train.py`) run these on the worker's trainer; the worker's context
replays them (`replay`) to bring a trainer from its last checkpoint to a later version. Both
compute a micro-batch the same way, so a replay reproduces the run's gradients exactly.

The loss of every micro-batch is scaled by one constant known from the config before any
rollout (`loss_scale`), so early backward of a micro-batch is exact however the batch is split
or ordered: the accumulated gradient equals the whole global batch's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from flexmarl_core.algorithms import advantage_scope, compute_advantages
from flexmarl_core.critic import is_critic
from flexmarl_core.critic_updates import step_critic, targets
from flexmarl_core.location import gradient_key
from flexmarl_core.ops import ConsistencyError, Op
from flexmarl_core.programs.manifest import committed_ids
from flexmarl_core.training.api import GradientTrainer, Sample, TrainBackend
from flexmarl_core.weights import load_gradient

if TYPE_CHECKING:
    from flexmarl_core.worker import WorkerContext

#: A micro-batch's store rows (each with its advantage), as read for training.
Rows = list[tuple[dict[str, Any], float]]


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


def accumulate(ctx: WorkerContext, tr: TrainBackend, agent: str,
               batch: list[Sample]) -> tuple[dict[str, float], list[Sample], list[Sample]]:
    """Forward + backward of `batch` into `tr` (zero-advantage samples skipped where the agent
    asks for it), the same way in a train op and in a step's or a replay's recomputation, so a
    replay reproduces the run's gradients exactly. Call with `ctx.lock` held."""
    skip = ctx.cfg.agent(agent).algorithm.skip_zero_advantage
    trained, skipped = skip_zero_advantage(batch) if skip else (batch, [])
    return tr.accumulate(trained, loss_scale=loss_scale(ctx, agent)), trained, skipped


def micro_batch(ctx: WorkerContext, tr: TrainBackend, op: Op) -> tuple[Rows, list[Sample]]:
    """The (row, advantage) pairs and training samples of `op`'s micro-batch, from the store."""
    agent, it, mb = op.agent, op.iteration, op.mb
    alg = ctx.cfg.agent(agent).algorithm
    # Group-scoped estimators need only this micro-batch (whole groups); batch-scoped ones
    # (REINFORCE++) normalise over the iteration, whose rewards the plan waits for.
    scope = advantage_scope(alg.advantage)
    whole = scope == "batch"
    # Consumed-or-not does not matter here: the trainer is still at `it`, so no update has
    # applied these samples yet; a `consumed_step` on them was written by an attempt whose
    # gradients died with its process (the version check keeps this exactly-once).
    if scope == "critic":  # GAE along the micro-batch's calls: the critics' rows hold this agent's
        chain, tg = targets(ctx, it, mb)
        rows = [r for r in chain if r["agent"] == agent]
    else:
        rows = ctx.store.ready(agent, it, need=("reward",), unconsumed=False, mb=None if whole else mb).to_pylist()
    num_mb = ctx.cfg.batch.num_micro_batches
    if ctx.meg.program is None:
        expected = samples_per_step(ctx, agent) // num_mb * (num_mb if whole else 1)
        if len(rows) != expected:
            raise RuntimeError(f"{op.name}: {len(rows)} samples ready, expected {expected}")
    else:  # a program's calls vary: exactly the samples its ops committed
        ids = committed_ids(ctx.loc, it, range(num_mb) if whole else [mb], agent)
        rows = [r for r in rows if r["sample_id"] in ids]
        if len(rows) != len(ids):
            missing = sorted(ids - {r["sample_id"] for r in rows})
            raise RuntimeError(f"{op.name}: {len(missing)} committed samples not ready, e.g. {missing[:3]}")
    check_staleness(agent, tr.version, rows, ctx.cfg.codesign.max_staleness)
    rows.sort(key=lambda r: r["sample_id"])
    per_token: list[list[float] | None] = [None] * len(rows)
    if scope == "critic":
        adv = [tg[r["sample_id"]].advantages[0] for r in rows]
        if ctx.cfg.critic.per_token:
            per_token = [tg[r["sample_id"]].advantages for r in rows]
    else:
        adv = advantages(alg.advantage, rows,
                         ctx.meg.program is not None and ctx.cfg.team.program_groups == "trajectory")
    mine = [(r, a, t) for r, a, t in zip(rows, adv, per_token, strict=True) if r["mb"] == mb]
    batch = [
        Sample(prompt_ids=r["prompt_ids"], response_ids=r["response_ids"], logprobs=r["logprobs"],
               advantage=a, loss_mask=r.get("loss_mask"), token_advantages=t)
        for r, a, t in mine
    ]
    return [(r, a) for r, a, _ in mine], batch


def advantages(estimator: str, rows: list[dict[str, Any]], per_trajectory: bool = False) -> list[float]:
    """Each row's advantage. Groups are an input's samples of one turn (a YAML team's round, a
    program's k-th call of the agent: AT-GRPO's agent-and-turn groups). `per_trajectory` (a
    program team's `program_groups: trajectory`): one reward per trajectory (its first sample's),
    normalised over the input's trajectories, and every sample of it gets that advantage."""
    if not per_trajectory:
        return compute_advantages(estimator, [float(r["reward"]) for r in rows],
                                  [f"{r['input_id']}:{r['turn']}" for r in rows]).tolist()
    trajs: dict[tuple[str, int], float] = {}
    for r in sorted(rows, key=lambda r: r["turn"]):
        trajs.setdefault((r["input_id"], r["traj"]), float(r["reward"]))
    keys = sorted(trajs)
    adv = compute_advantages(estimator, [trajs[k] for k in keys], [k[0] for k in keys]).tolist()
    of = dict(zip(keys, adv, strict=True))
    return [of[(r["input_id"], r["traj"])] for r in rows]


def mark_consumed(ctx: WorkerContext, agent: str, it: int, mb: int, mine: Rows) -> None:
    """Status rows: these samples trained the update of iteration `it` (with their advantage)."""
    ctx.store.write_status(agent, it, [
        {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb,
         "advantage": a, "consumed_step": it}
        for r, a in mine
    ])


class Stepped(NamedTuple):
    """What a step did: its grad norm, the micro-batches accumulated again and those added from a
    gradient helper, and metrics only a critic's step has (its explained variance)."""

    grad_norm: float
    missing: list[int]
    helped: list[int]
    metrics: dict[str, float]


def step_trainer(ctx: WorkerContext, agent: str, tr: TrainBackend, it: int,
                 *, replaying: bool = False) -> Stepped:
    """Step `tr` from version `it`. A micro-batch whose gradient is not in it is added from its
    gradient helper's file (`stages.train.train_gradient`) if there is one, else accumulated
    again from the store (it died with another process, the trainer moved, or a replay): same
    samples, same gradients. A critic steps through `critic_updates.step_critic`. Call with
    `ctx.lock` held."""
    if is_critic(ctx.cfg, agent):
        grad_norm, missing, metrics = step_critic(ctx, agent, tr, it)  # type: ignore[arg-type]
        return Stepped(grad_norm, missing, [], metrics)
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


def replay(ctx: WorkerContext, agent: str, tr: TrainBackend, version: int) -> None:
    """Bring `tr` to `version` by redoing the steps since its own version from the samples in
    the store (their rewards and advantages are already there): the steps after the last
    checkpoint, after a restart. The samples stay as they are (already marked consumed)."""
    while tr.version < version:
        step_trainer(ctx, agent, tr, tr.version, replaying=True)
