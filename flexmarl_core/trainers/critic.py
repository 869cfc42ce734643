"""The critic trainer kind: a critic's work on the MEG Store's samples (the values of a
micro-batch for its `value` op, the GAE targets every train op reads, its micro-batch backward
and its step), the same way in an op and in a replay after a restart, as `policy.py` does for
an agent. Which critics a run has, and what each values: `config/critic.py`.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flexmarl_core.algorithms.gae import explained_variance, gae_chain, gae_tokens
from flexmarl_core.config.critic import base_agent, critic_names
from flexmarl_core.inference.api import synced_now
from flexmarl_core.ops import ConsistencyError, Op, StageResult, agent_key
from flexmarl_core.runfiles.weights import load_weights
from flexmarl_core.trainers.kinds import AuditCheck, Stepped, register_trainer_kind
from flexmarl_core.training.api import TrainBackend
from flexmarl_core.training.critic import CriticTrainer, ValueSample

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.runtime.view import WorkerView


@dataclass(frozen=True, slots=True)
class Target:
    """One sample's GAE: per call one entry each, per token one per response token."""

    old_values: list[float]
    advantages: list[float]
    returns: list[float]


def chain_rows(ctx: WorkerView, it: int, mb: int) -> list[dict[str, Any]]:
    """Every valued call of micro-batch `mb` (rewards and values set), in chain order."""
    rows = []
    for agents in critic_names(ctx.cfg).values():
        for a in agents:
            rows += ctx.store.ready(a, it, need=("reward", "value"), unconsumed=False, mb=mb).to_pylist()
    order = ctx.team.call_order()
    rows.sort(key=lambda r: (r["input_id"], r["traj"], order[(r["agent"], r["turn"])]))
    return rows


def targets(ctx: WorkerView, it: int, mb: int) -> tuple[list[dict[str, Any]], dict[str, Target]]:
    """(rows in chain order, sample_id -> Target) of micro-batch `mb`: the same figures in
    every train op that reads them (the critic's and the agents')."""
    rows = chain_rows(ctx, it, mb)
    ccfg = ctx.cfg.critic
    chains: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        chains[(r["input_id"], r["traj"])].append(r)
    out: dict[str, Target] = {}
    for chain in chains.values():
        rewards = [float(r["reward"]) for r in chain]
        if ccfg.per_token:
            vals = [list(r["token_values"] or []) for r in chain]
            if any(len(v) != len(r["response_ids"]) for v, r in zip(vals, chain, strict=True)):
                raise RuntimeError(f"iteration {it} mb {mb}: a sample's token_values do not match its "
                                   "response (critic.per_token changed within the run?)")
            adv, ret = gae_tokens(rewards, vals, gamma=ccfg.gamma, lam=ccfg.lam)
            for r, v, a, g in zip(chain, vals, adv, ret, strict=True):
                out[r["sample_id"]] = Target(v, a, g)
        else:
            vals1 = [float(r["value"]) for r in chain]
            adv1, ret1 = gae_chain(rewards, vals1, gamma=ccfg.gamma, lam=ccfg.lam)
            for r, v1, a1, g1 in zip(chain, vals1, adv1, ret1, strict=True):
                out[r["sample_id"]] = Target([v1], [a1], [g1])
    return rows, out


def samples_per_iteration(ctx: WorkerView, critic: str) -> int:
    """Calls the critic values per iteration."""
    agents = set(critic_names(ctx.cfg)[critic])
    calls = sum(1 for n in ctx.meg.nodes if n.agent in agents)
    return ctx.cfg.batch.inputs_per_iteration * ctx.cfg.batch.group_size * calls


def loss_scale(ctx: WorkerView, critic: str) -> float:
    """1 / (calls per iteration [x max new tokens, per token]): fixed before any backward, as
    an agent's (`trainers/policy.py` `loss_scale`)."""
    per = 1
    if ctx.cfg.critic.per_token:
        per = max(ctx.cfg.agent(a).sampling.max_new_tokens for a in critic_names(ctx.cfg)[critic])
    return 1.0 / (samples_per_iteration(ctx, critic) * per)


def compute_values(ctx: WorkerView, critic: str, tr: CriticTrainer, it: int, mb: int) -> int:
    """The critic's values of micro-batch `mb`'s calls of its agents, written to the store as
    status rows (`value`, and `token_values` per token). Returns the samples valued."""
    n = 0
    for agent in critic_names(ctx.cfg)[critic]:
        rows = ctx.store.read_samples(agent, it, mb=mb, columns=[
            "sample_id", "policy_version", "prompt_ids", "response_ids"]).to_pylist()
        if not rows:
            raise RuntimeError(f"value[{critic}] it={it} mb={mb}: no samples of agent {agent!r} in the store")
        vals = tr.values([ValueSample(r["prompt_ids"], r["response_ids"], agent) for r in rows])
        per_token = ctx.cfg.critic.per_token
        ctx.store.write_status(agent, it, [
            {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb,
             "value": v[0], "token_values": v if per_token else None}
            for r, v in zip(rows, vals, strict=True)])
        n += len(rows)
    return n


def valued(ctx: WorkerView, critic: str, it: int, mb: int) -> bool:
    """Whether every call of micro-batch `mb` that `critic` values has its value stored."""
    for agent in critic_names(ctx.cfg)[critic]:
        tbl = ctx.store.read_samples(agent, it, mb=mb, columns=["sample_id", "value"])
        if tbl.num_rows == 0 or tbl.column("value").null_count:
            return False
    return True


def critic_batch(ctx: WorkerView, critic: str, it: int, mb: int) -> list[ValueSample]:
    """The critic's training samples of micro-batch `mb`: its agents' calls with the values the
    advantages used and their GAE returns."""
    mine = set(critic_names(ctx.cfg)[critic])
    rows, tg = targets(ctx, it, mb)
    return [ValueSample(r["prompt_ids"], r["response_ids"], r["agent"], tg[r["sample_id"]].old_values,
                        tg[r["sample_id"]].returns) for r in rows if r["agent"] in mine]


def accumulate(ctx: WorkerView, critic: str, tr: CriticTrainer, it: int, mb: int,
               batch: list[ValueSample] | None = None) -> tuple[dict[str, float], int]:
    """Backward of micro-batch `mb` (its `critic_batch`, read here unless given) into the
    critic's gradients; (per-agent metrics, samples)."""
    batch = critic_batch(ctx, critic, it, mb) if batch is None else batch
    scale = loss_scale(ctx, critic)
    device = getattr(tr, "device", None)
    t0 = synced_now(device)
    stats = tr.accumulate(batch, loss_scale=scale, key=(it, mb))
    fwd_bwd_s = synced_now(device) - t0
    counts: dict[str, int] = defaultdict(int)
    for s in batch:
        counts[s.agent] += len(s.returns)
    # per agent: the mean value loss of its valued positions in this micro-batch
    metrics = {agent_key(a, "value_loss"): stats[f"value_loss/{a}"] / (scale * c) for a, c in counts.items()}
    metrics[agent_key(critic, "train/value_loss")] = stats["value_loss"] / (scale * sum(counts.values()))
    metrics[agent_key(critic, "train/fwd_bwd_s")] = fwd_bwd_s
    return metrics, len(batch)


def step_critic(ctx: WorkerView, critic: str, tr: CriticTrainer,
                it: int) -> tuple[float, list[int], dict[str, float]]:
    """Step the critic from version `it`, first accumulating any micro-batch not in its
    gradients (died with another process, moved, or a replay), then its further epochs over
    the iteration's micro-batches (`critic.epochs`). Returns the grad norm, the recomputed
    micro-batches and per agent the explained variance of the values the iteration's
    advantages used (`agent/<a>/explained_var`; none where its returns did not vary). Every
    micro-batch is read once, before any update. Call with `ctx.lock` held."""
    done = ctx.accumulated.setdefault(critic, set())
    batches = {j: critic_batch(ctx, critic, it, j) for j in range(ctx.cfg.batch.num_micro_batches)}
    missing = [j for j in batches if (it, j) not in done]
    for j in missing:
        accumulate(ctx, critic, tr, it, j, batches[j])
    epoch = [((it, j), b) for j, b in batches.items()]
    res = tr.step([epoch] * (ctx.cfg.critic.epochs - 1), loss_scale(ctx, critic))
    done.clear()
    pairs: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for s in (s for b in batches.values() for s in b):
        pairs[s.agent][0].extend(s.old_values)
        pairs[s.agent][1].extend(s.returns)
    ev = {agent_key(a, "explained_var"): explained_variance(v, g) for a, (v, g) in pairs.items()}
    return res.grad_norm, missing, {k: v for k, v in ev.items() if v == v}  # NaN left out


def critic_trainer(ctx: WorkerView, critic: str, it: int) -> tuple[CriticTrainer, dict[str, float]]:
    """This process's trainer of `critic` at `it` (and swap figures), checked to be a critic's."""
    with ctx.lock:
        tr, swap = ctx.trainer(critic, it)
    if not isinstance(tr, CriticTrainer):
        raise TypeError(f"{critic!r}: expected a critic's trainer, got {type(tr).__name__}")
    return tr, swap


@register_trainer_kind("critic")
class CriticKind:
    """A value model beside the agents (`algorithm.advantage: gae`): its `value` op
    (`stages/value.py`) stores the values the agents' advantages use; its train op regresses
    on the GAE returns. No rollout instance serves it."""

    serves_instances = False

    def audited(self, cfg: ExperimentConfig, critic: str) -> dict[str, list[AuditCheck]]:
        """Every call of the agents it values has the value their advantages used."""
        return {a: [AuditCheck("value", "unvalued", "have no critic value")] for a in critic_names(cfg)[critic]}

    def new_trainer(self, ctx: WorkerView, critic: str) -> TrainBackend:
        """A seeded value head on a frozen copy of its base agent's initial model
        (`config.critic.base_agent`)."""
        src, ccfg = base_agent(ctx.cfg, critic), ctx.cfg.critic
        model, tok = ctx.fresh_model(src)
        if ctx.cfg.agent(src).model.lora is None:
            model.load_state_dict(load_weights(ctx.loc, src, 0))
        return CriticTrainer(model, hidden=ccfg.head_hidden, per_token=ccfg.per_token, lr=ccfg.lr,
                             max_grad_norm=ccfg.max_grad_norm, value_clip=ccfg.value_clip,
                             seed=zlib.crc32(f"{ctx.cfg.seed}:{critic}".encode()), pad_id=tok.pad_token_id or 0,
                             agents=critic_names(ctx.cfg)[critic])

    def train(self, ctx: WorkerView, op: Op) -> StageResult:
        """Backward of the critic's value loss on one micro-batch (GAE returns from the stored
        values and rewards) into its accumulated gradients."""
        critic, it, mb = op.agent, op.iteration, op.mb
        tr, swap = critic_trainer(ctx, critic, it)
        done = ctx.accumulated.setdefault(critic, set())
        if tr.version != it or (it, mb) in done:
            return StageResult(op, skipped=True, swap=swap)  # a retry after the work was done
        with ctx.lock:
            metrics, n = accumulate(ctx, critic, tr, it, mb)
            done.add((it, mb))
        return StageResult(op, samples=n, tokens=n, swap=swap, metrics=metrics)

    def step(self, ctx: WorkerView, critic: str, tr: TrainBackend, it: int, *,
             replaying: bool = False) -> Stepped:
        if not isinstance(tr, CriticTrainer):
            raise TypeError(f"{critic!r}: expected a critic's trainer, got {type(tr).__name__}")
        grad_norm, missing, metrics = step_critic(ctx, critic, tr, it)
        return Stepped(grad_norm, missing, [], metrics)


def value(ctx: WorkerView, op: Op) -> StageResult:
    """The critic at version `it` values the micro-batch's calls of its agents (the values the
    advantages of iteration `it` use). A retry after the critic stepped finds them stored."""
    critic, it, mb = op.agent, op.iteration, op.mb
    tr, swap = critic_trainer(ctx, critic, it)
    if tr.version != it:
        if valued(ctx, critic, it, mb):  # a rerun after the critic stepped (resume): done
            return StageResult(op, skipped=True, swap=swap)
        raise ConsistencyError(f"{op.name}: the critic is at version {tr.version}, expected {it}, and "
                               "the micro-batch has no values (its step ran before it was valued)")
    with ctx.lock:
        n = compute_values(ctx, critic, tr, it, mb)
    return StageResult(op, samples=n, version=it, swap=swap)
