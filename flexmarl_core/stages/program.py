"""Program: a program team's trajectories of one micro-batch (or, without dependency_parallel,
the whole batch), run against flexmarl's endpoint, scored, and written to the MEG Store.

Each trajectory's calls decode on the agents' instances (`ProgramHost.dispatcher`), batched per
agent across the op's trajectories. The op writes every agent's sample rows, then their
rewards as status rows, then one manifest per micro-batch (`location.program_key`): the sample
ids that count, and the trajectories that failed. The manifest is the op's commit point: a
retry whose manifest exists finds its work done, and an agent's train op trains on exactly the
manifest's samples, so a rerun program op (calls are seeded by their identity, so it writes the
same rows again) never adds or loses one.
"""

from __future__ import annotations

import json
from statistics import median
from typing import Any

from flexmarl_core.inference.api import Generation
from flexmarl_core.ops import Op, StageResult, agent_key
from flexmarl_core.programs.api import DecodeGroup, DecodeStats
from flexmarl_core.programs.engines import LocalDispatcher, current_host
from flexmarl_core.programs.team import program_team, score
from flexmarl_core.runfiles.location import program_key
from flexmarl_core.runtime.worker import WorkerContext, context
from flexmarl_core.stages.registry import stage, stage_seed, weights_version, worker_name
from flexmarl_core.workloads.api import Problem


@stage("program")
def program(ctx: WorkerContext, op: Op) -> StageResult:
    it = op.iteration
    mbs, done = committed(ctx, op)
    if done is not None:
        return done
    team = program_team(ctx.cfg.team, ctx.cfg.seed)
    inputs = [(j, inp) for j in mbs for inp in ctx.inputs(it, j)]
    problems = {inp["input_id"]: Problem(inp["input_id"], inp["text"], inp["answer"], inp["meta"]) for _, inp in inputs}
    jobs = [(inp["input_id"], traj, j, inp["text"]) for j, inp in inputs for traj in range(ctx.cfg.batch.group_size)]
    versions = {a: weights_version(ctx, a, it) for a in ctx.meg.agent_names}
    seed = ctx.cfg.seed
    host = current_host()
    with host.detached():  # the op waits on its calls; the worker runs other ops meanwhile
        results, session = team.run(jobs, host.dispatcher(ctx, worker_name()), versions,
                                    lambda i, t, a, c: stage_seed(seed, it, i, t, a, c), where=op.name)
    got = score(team, ctx.workload, problems, results, set(ctx.meg.trainable_agents), ctx.reward_deadline)
    for agent, rows in got.rows.items():
        ctx.store.write_samples(agent, it, rows)
    for agent, rows in got.status.items():
        ctx.store.write_status(agent, it, rows)
    res = _result(op, got, results, session, versions)
    commit(ctx, it, {j: got.manifest.get(j, {"samples": {}, "failed": []}) for j in mbs}, versions, res)
    return res


def commit(ctx: WorkerContext, it: int, manifests: dict[int, dict[str, Any]], versions: dict[str, int],
           res: StageResult) -> None:
    """Write each micro-batch's manifest, with the weights versions and what the op did (what
    `committed` reports to a retry): last, as its presence means the op is done."""
    done = {"samples": res.samples, "tokens": res.tokens, "version": res.version, "metrics": res.metrics}
    for j, man in manifests.items():
        ctx.loc.write_text(program_key(it, j), json.dumps({**man, "versions": versions, "result": done}))


def committed(ctx: WorkerContext, op: Op) -> tuple[list[int], StageResult | None]:
    """The micro-batches a program or episode op commits, and, for a retry after the op
    committed (its worker died before the driver logged it), what the committed op did (from
    its manifest), so the iteration's figures count that work once; else None."""
    it = op.iteration
    mbs = [op.mb] if op.mb >= 0 else list(range(ctx.cfg.batch.num_micro_batches))
    if not all(ctx.loc.is_file(program_key(it, j)) for j in mbs):
        return mbs, None
    done = json.loads(ctx.loc.read_text(program_key(it, mbs[0]))).get("result", {})
    return mbs, StageResult(op, skipped=True, samples=done.get("samples", 0), tokens=done.get("tokens", 0),
                            version=done.get("version"), metrics=done.get("metrics", {}))


def decode_on_instance(run_dir: str, agent: str, version: int,
                       groups: list[DecodeGroup]) -> tuple[list[list[Generation]], DecodeStats]:
    """A program op's batch of `agent`'s calls, decoded on this worker's engine of the agent
    (what a cluster's dispatcher runs on the instance it picked)."""
    stats = DecodeStats()
    gens = LocalDispatcher.of_context(context(run_dir), worker_name()).decode(agent, version, groups, stats)
    return gens, stats


def _result(op: Op, got: Any, results: list, session: Any, versions: dict[str, int]) -> StageResult:
    tokens = sum(sum(r["loss_mask"].count(1) if r["loss_mask"] else len(r["response_ids"]) for r in rows)
                 for rows in got.rows.values())
    dropped = sum(1 for r in results if r.error is not None and r.policy_error is None)
    broke = [r for r in results if r.policy_error is not None]
    n_ok = len(results) - dropped  # trajectories whose calls count: answered, or broken by the policy
    lat = sorted(max(c - e, 0.0) for r in results for c, e in r.latencies)
    untrained = sum(1 for m in got.manifest.values() for f in m["failed"] if not f.get("trained"))
    metrics: dict[str, float] = {
        "team/accuracy": sum(got.correct) / max(len(got.correct), 1),
        "team/program/failed": float(dropped),
        "team/program/policy_failed": float(len(broke)),
        "team/reward/failed": float(untrained - dropped),
        "team/program/requests_per_decode": sum(d[1] for d in session.decodes) / max(len(session.decodes), 1),
        "team/program/decodes": float(len(session.decodes)),
    }
    if lat:
        metrics["team/program/call_overhead_ms_p50"] = 1e3 * median(lat)
        metrics["team/program/call_overhead_ms_p99"] = 1e3 * lat[min(int(0.99 * len(lat)), len(lat) - 1)]
    if session.overheads:  # the endpoint's own share of it (parsing, templating, tokenising, JSON)
        metrics["team/program/server_overhead_ms_p50"] = 1e3 * median(session.overheads)
    for r in broke:  # by exception type and by agent: what the policy keeps breaking
        key = f"team/program/policy_failed/{r.policy_error}"
        metrics[key] = metrics.get(key, 0.0) + 1.0
        for rec in r.records:
            k = agent_key(rec.agent, "program/policy_failed_calls")
            metrics[k] = metrics.get(k, 0.0) + 1.0
    for agent, rewards in got.rewards.items():
        metrics[agent_key(agent, "reward")] = sum(rewards) / max(len(rewards), 1)
    for agent, calls in got.calls.items():
        metrics[agent_key(agent, "calls")] = calls / max(n_ok, 1)
    for agent in versions:  # what the balancer weighs each agent by (control/balancer.py)
        metrics[agent_key(agent, "program/decode_s")] = sum(d.seconds for a, _, _, d in session.decodes if a == agent)
    busy = [[d.instance, d.t_start, d.t_end] for _, _, _, d in session.decodes if d.instance]
    return StageResult(op, samples=sum(len(r) for r in got.rows.values()), tokens=tokens,
                       version=max(versions.values(), default=0), metrics=metrics, busy=busy)
