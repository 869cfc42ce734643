"""Episode: an environment team's episodes of one micro-batch (or the batch), played on the
agents' instances; each trainable agent's answers become its sample rows, credited with their
seat's return as status rows, then one manifest per micro-batch (`location.program_key`, as a
program op's) lists the committed sample ids: its presence means the op is done.

    per_turn    one sample per answer, prompted with what the seat saw then
    multi_turn  one sample per seat and episode: its answers, the observations between them
                masked (loss_mask 0, log-prob 0), as a tool loop's sample is

A sample's id is `{input_id}:{traj}:{agent}:{k}`, k the index of its (first) answer among the
agent's answers in the episode, so GRPO groups an input's episodes (one deal) by the agent's
k-th answer. Rerun with the same seeds (a lost worker), the op writes the same rows.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from flexmarl_core.envs.play import Answer, Played
from flexmarl_core.meg import sample_id
from flexmarl_core.ops import Op, StageResult, agent_key
from flexmarl_core.programs.api import DecodeStats
from flexmarl_core.programs.engines import current_host
from flexmarl_core.runtime.worker import WorkerContext
from flexmarl_core.stages.program import commit, committed
from flexmarl_core.stages.registry import stage, stage_seed, weights_version, worker_name
from flexmarl_core.teams.environment import EnvironmentTeam


@stage("episode")
def episode(ctx: WorkerContext, op: Op) -> StageResult:
    it = op.iteration
    mbs, done = committed(ctx, op)
    if done is not None:
        return done
    team = ctx.team
    if not isinstance(team, EnvironmentTeam):
        raise TypeError(f"{op.name}: an episode op plays an environment team's episodes, not a "
                        f"{type(team).__name__}'s")
    jobs = [(inp["input_id"], traj, j) for j in mbs for inp in ctx.inputs(it, j)
            for traj in range(ctx.cfg.batch.group_size)]
    versions = {a: weights_version(ctx, a, it) for a in ctx.meg.agent_names}
    seed = ctx.cfg.seed
    decodes: list[tuple[str, DecodeStats]] = []
    host = current_host()
    with host.detached():  # the op waits on its decodes; the worker runs other ops meanwhile
        played = team.play(jobs, host.dispatcher(ctx, worker_name()), versions,
                           lambda i, t, a, k: stage_seed(seed, it, i, t, a, k), decodes=decodes)
    trainable = set(ctx.meg.trainable_agents)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    status: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in played:
        for agent, sample, reward in _samples(team, p, trainable):
            rows[agent].append(sample)
            status[agent].append({"sample_id": sample["sample_id"], "policy_version": sample["policy_version"],
                                  "mb": p.mb, "reward": reward})
    for agent in sorted(rows):
        ctx.store.write_samples(agent, it, rows[agent])
        ctx.store.write_status(agent, it, status[agent])
    learning = {s for s, c in team.ecfg.seats.items() if c.agent in trainable and c.learns}
    res = _result(op, played, rows, status, decodes, versions, learning)
    commit(ctx, it, {j: {"samples": {a: sorted(r["sample_id"] for r in rs if r["mb"] == j) for a, rs in rows.items()},
                         "failed": []} for j in mbs}, versions, res)
    return res


def _samples(team: EnvironmentTeam, p: Played, trainable: set[str]) -> list[tuple[str, dict[str, Any], float]]:
    """(agent, sample row, reward) of a played episode's trainable answers."""
    by_seat: dict[str, list[Answer]] = defaultdict(list)
    for a in p.answers:
        if a.agent in trainable and a.reply is not None and team.ecfg.seats[a.seat].learns:
            by_seat[a.seat].append(a)
    out = []
    multi = team.ecfg.samples == "multi_turn"
    for seat, answers in by_seat.items():
        for run in (_continued(answers) if multi else [[a] for a in answers]):
            first = run[0]
            ids, text = first.prompt_ids, first.prompt_text
            response: list[int] = []
            logprobs: list[float] = []
            mask: list[int] = []
            texts: list[str] = []
            for n, a in enumerate(run):
                if n:  # the observation between two answers: what the seat's next prompt adds
                    inserted = a.prompt_ids[len(ids) + len(response):]
                    response += inserted
                    logprobs += [0.0] * len(inserted)
                    mask += [0] * len(inserted)
                    texts.append(team.tokenizer(a.agent).decode(inserted))
                g = a.reply
                response += list(g.response_ids)
                logprobs += list(g.logprobs)
                mask += list(g.loss_mask) if g.loss_mask is not None else [1] * len(g.response_ids)
                texts.append(g.text)
            sid = sample_id(p.input_id, p.traj, first.agent, first.k)
            out.append((first.agent, {
                "sample_id": sid, "input_id": p.input_id, "traj": p.traj, "turn": first.k, "mb": p.mb,
                "policy_version": first.reply.version, "parents": [],
                "prompt_ids": ids, "response_ids": response, "logprobs": logprobs,
                "loss_mask": None if all(mask) else mask, "prompt_text": text, "response_text": "".join(texts),
                "extra": json.dumps({"seat": seat, "answers": [a.k for a in run],
                                     "valid": [a.valid for a in run]}),
            }, first.ret))
    return out


def _continued(answers: list[Answer]) -> list[list[Answer]]:
    """A seat's answers in runs whose prompts continue each other token for token (the chat
    template re-renders the conversation; where it does not extend the earlier prompt and
    answer exactly, or the weights version changed, a new sample starts)."""
    runs: list[list[Answer]] = []
    full: list[int] = []
    for a in answers:
        ids = a.prompt_ids
        if runs and runs[-1][-1].reply.version == a.reply.version and ids[:len(full)] == full:
            runs[-1].append(a)
        else:
            runs.append([a])
        full = ids + list(a.reply.response_ids)
    return runs


def _result(op: Op, played: list[Played], rows: dict[str, list[dict[str, Any]]],
            status: dict[str, list[dict[str, Any]]], decodes: list[tuple[str, DecodeStats]],
            versions: dict[str, int], learning: set[str]) -> StageResult:
    """`learning`: the seats whose answers train (their win rate is the op's accuracy)."""
    wins = [p.returns.get(s, 0.0) > 0 for p in played for s in sorted(learning) if s in p.returns]
    answers = [a for p in played for a in p.answers]
    metrics: dict[str, float] = {
        "team/accuracy": sum(wins) / max(len(wins), 1),
        "team/env/episodes": float(len(played)),
        "team/env/answers_per_episode": len(answers) / max(len(played), 1),
        "team/env/invalid": float(sum(1 for a in answers if not a.valid)),
        "team/env/forfeits": float(sum(1 for p in played if p.forfeit)),
        "team/env/truncated": float(sum(1 for p in played if p.truncated)),
    }
    for seat in sorted({s for p in played for s in p.returns}):
        metrics[f"team/env/return/{seat}"] = sum(p.returns.get(seat, 0.0) for p in played) / max(len(played), 1)
    for agent, st in status.items():
        metrics[agent_key(agent, "reward")] = sum(s["reward"] for s in st) / max(len(st), 1)
    for agent in versions:  # what the balancer weighs each agent by (control/balancer.py)
        metrics[agent_key(agent, "program/decode_s")] = sum(d.seconds for a, d in decodes if a == agent)
    tokens = sum((r["loss_mask"] or [1] * len(r["response_ids"])).count(1) for rs in rows.values() for r in rs)
    busy = [[d.instance, d.t_start, d.t_end] for _, d in decodes if d.instance]
    return StageResult(op, samples=sum(len(r) for r in rows.values()), tokens=tokens,
                       version=max(versions.values(), default=0), metrics=metrics, busy=busy)
