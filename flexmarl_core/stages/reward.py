"""Reward: score one micro-batch of trajectories and append the rewards to the store.

Each trajectory's scoring runs under the reward's deadline (`WorkerContext.reward_deadline`):
an input whose reward runs past it fails with all its trajectories, which get no reward and
train nobody; they are listed in the micro-batch's reward manifest (`location.reward_key`),
which the team's shape reads to say which samples training and the audit expect.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from flexmarl_core.ops import Op, StageResult, agent_key
from flexmarl_core.runfiles.location import reward_key
from flexmarl_core.runtime.worker import WorkerContext
from flexmarl_core.stages.registry import stage
from flexmarl_core.workloads.api import Problem
from flexmarl_core.workloads.base import step_discount


@stage("reward")
def reward(ctx: WorkerContext, op: Op) -> StageResult:
    """Each trajectory's outputs (every agent's last turn) go to the workload's reward; each
    trainable agent gets its share as a status row of its samples."""
    it, mb = op.iteration, op.mb
    inputs = {r["input_id"]: r for r in ctx.inputs(it, mb)}
    samples: dict[str, list[dict[str, Any]]] = {}
    final: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
    for agent in ctx.meg.agent_names:
        rows = ctx.store.read_samples(agent, it, mb=mb, columns=["sample_id", "input_id", "traj", "turn", "policy_version", "response_text"]).to_pylist()
        samples[agent] = rows
        for r in sorted(rows, key=lambda r: r["turn"]):
            final[(r["input_id"], r["traj"])][agent] = r["response_text"]
    rewards: dict[tuple[str, int], dict[str, float]] = {}
    correct = []
    failed: dict[tuple[str, int], str] = {}
    wl = ctx.workload
    keys = list(final)
    problems = {i: Problem(input_id=i, text=inputs[i]["text"], answer=inputs[i]["answer"], meta=inputs[i]["meta"])
                for i in dict.fromkeys(i for i, _ in keys)}
    # Once one trajectory of an input runs past the deadline, its input's others are not scored
    # and fail with it.
    got_all = ctx.reward_deadline.call_many([
        (lambda p=problems[i], o=final[(i, t)]: (wl.reward(p, o), float(wl.is_correct(p, o))), i) for i, t in keys])
    hung: set[str] = set()
    for (input_id, traj), (ok, got) in zip(keys, got_all, strict=True):
        if not ok or got is None:
            failed[(input_id, traj)] = (
                "its input's reward ran past its deadline" if input_id in hung
                else f"the reward ran past its deadline of {ctx.reward_deadline.seconds:g} s")
            hung.add(input_id)
            continue
        rewards[(input_id, traj)], acc = got
        correct.append(acc)
    metrics = {"team/accuracy": sum(correct) / max(len(correct), 1), "team/reward/failed": float(len(failed))}
    order = ctx.team.call_order() if ctx.cfg.workload.credit == "step_discount" else {}
    for agent, rows in samples.items():
        # The last turn gets the trajectory's reward; the workload may pay earlier turns for
        # their own work (`turn_rewards`).
        turns: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            if (r["input_id"], r["traj"]) not in failed:
                turns[(r["input_id"], r["traj"])].append(r)
        per_sample: dict[str, float] = {}
        for key, trs in turns.items():
            trs.sort(key=lambda r: r["turn"])
            given = wl.turn_rewards(problems[key[0]], agent, [r["response_text"] for r in trs], rewards[key][agent])
            if order:  # credit: step_discount, by the call's place in the trajectory
                given = [step_discount(v, order[(agent, r["turn"])], len(order), ctx.cfg.workload.credit_gamma)
                         for r, v in zip(trs, given, strict=True)]
            per_sample.update((r["sample_id"], float(v)) for r, v in zip(trs, given, strict=True))
        status = [
            {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb,
             "reward": per_sample[r["sample_id"]]}
            for r in rows if r["sample_id"] in per_sample
        ]
        if ctx.cfg.agent(agent).trainable:
            ctx.store.write_status(agent, it, status)
        metrics[agent_key(agent, "reward")] = sum(s["reward"] for s in status) / max(len(status), 1)
    if failed:  # last: what training reads to leave them out
        ctx.loc.write_text(reward_key(it, mb), json.dumps({"failed": [
            {"input_id": i, "traj": t, "error": why} for (i, t), why in sorted(failed.items())]}))
    return StageResult(op, samples=len(correct), metrics=metrics)
