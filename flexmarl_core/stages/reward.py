"""Reward: score one micro-batch of trajectories and append the rewards to the store."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from flexmarl_core.ops import Op, StageResult, agent_key
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
    problems: dict[str, Problem] = {}
    for (input_id, traj), outputs in final.items():
        inp = inputs[input_id]
        problem = problems.setdefault(input_id, Problem(input_id=input_id, text=inp["text"],
                                                        answer=inp["answer"], meta=inp["meta"]))
        rewards[(input_id, traj)] = ctx.workload.reward(problem, outputs)
        correct.append(float(ctx.workload.is_correct(problem, outputs)))
    metrics = {"team/accuracy": sum(correct) / max(len(correct), 1)}
    wl = ctx.cfg.workload
    order = ctx.team.call_order() if wl.credit == "step_discount" else {}
    for agent, rows in samples.items():
        # The last turn gets the trajectory's reward; the workload may pay earlier turns for
        # their own work (`turn_rewards`).
        turns: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            turns[(r["input_id"], r["traj"])].append(r)
        per_sample: dict[str, float] = {}
        for key, trs in turns.items():
            trs.sort(key=lambda r: r["turn"])
            given = ctx.workload.turn_rewards(problems[key[0]], agent, [r["response_text"] for r in trs],
                                              rewards[key][agent])
            if order:  # credit: step_discount, by the call's place in the trajectory
                given = [step_discount(v, order[(agent, r["turn"])], len(order), wl.credit_gamma)
                         for r, v in zip(trs, given, strict=True)]
            per_sample.update((r["sample_id"], float(v)) for r, v in zip(trs, given, strict=True))
        status = [
            {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb,
             "reward": per_sample[r["sample_id"]]}
            for r in rows
        ]
        if ctx.cfg.agent(agent).trainable:
            ctx.store.write_status(agent, it, status)
        metrics[agent_key(agent, "reward")] = sum(s["reward"] for s in status) / max(len(status), 1)
    return StageResult(op, samples=len(correct), metrics=metrics)
