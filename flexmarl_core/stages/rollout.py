"""Rollout: one agent's turn on one micro-batch, written to the MEG Store."""

from __future__ import annotations

from flexmarl_core.inference.api import PartialBackend
from flexmarl_core.inference.tools import generate_with_tool, tool_of
from flexmarl_core.meg import NodeKey, sample_id
from flexmarl_core.ops import Op, StageResult, agent_key
from flexmarl_core.runtime.worker import WorkerContext
from flexmarl_core.stages.registry import (
    RESUME_EVERY,
    newer_weights,
    stage,
    stage_seed,
    weights_version,
)
from flexmarl_core.teams.graph import prompt


@stage("rollout")
def rollout(ctx: WorkerContext, op: Op) -> StageResult:
    """Render each trajectory's prompt from its parents' responses (read from the store),
    generate with the agent's weights of this iteration, write the samples."""
    agent, it, mb, turn = op.agent, op.iteration, op.mb, op.turn
    parents = ctx.meg.parents[NodeKey(agent, turn)]
    inputs = ctx.inputs(it, mb)
    parent_text: dict[str, str] = {}
    for p in parents:
        tbl = ctx.store.read_samples(p.agent, it, mb=mb, columns=["sample_id", "response_text"])
        parent_text.update(zip(tbl.column("sample_id").to_pylist(), tbl.column("response_text").to_pylist(), strict=True))
    prompts, meta = [], []
    for inp in inputs:
        for traj in range(ctx.cfg.batch.group_size):
            outs = {}
            for p in parents:
                sid = sample_id(inp["input_id"], traj, p.agent, p.turn)
                if sid not in parent_text:
                    raise RuntimeError(f"{op.name}: parent sample {sid} missing")
                outs[p.agent] = parent_text[sid]
            prompts.append(prompt(ctx.meg, agent, inp["text"], outs))
            meta.append((inp["input_id"], traj, [sample_id(inp["input_id"], traj, p.agent, p.turn) for p in parents]))
    version = weights_version(ctx, agent, it)
    sampling, seed = ctx.cfg.agent(agent).sampling, stage_seed(ctx.cfg.seed, it, agent, turn, mb)
    tool = tool_of(ctx.workload, agent)
    mixer = ctx.coalescer(agent) if tool is None else None  # a tool loop decodes on its own
    mix: dict[str, float] = {"ops": 1.0, "agents": 1.0}
    if mixer is not None:  # one decode with the rollouts of this base running beside it
        gens, mix = mixer.generate(agent, version, prompts, sampling, seed)
        pushed = int(mix["pushed"])
    else:
        with ctx.lock:
            pushed = ctx.pushed_loads
            eng = ctx.engine(agent, version)
            pushed = ctx.pushed_loads - pushed  # 1: the weights came from a sync's broadcast
            clock = getattr(eng, "clock", None)  # the HF engine's; the engine is ours under the lock
            before = clock.copy() if clock is not None else None
            if ctx.cfg.codesign.partial_rollouts and tool is None and isinstance(eng, PartialBackend):
                gens = eng.generate_partial(prompts, sampling, seed, newer_weights(ctx, op, eng), RESUME_EVERY)
            else:
                gens = generate_with_tool(eng, prompts, sampling, seed, tool)
            if clock is not None and before is not None:
                mix.update(clock.since(before))
    rows = [
        {
            "sample_id": sample_id(input_id, traj, agent, turn),
            "input_id": input_id, "traj": traj, "turn": turn, "mb": mb,
            "policy_version": g.version, "parents": par,
            "prompt_ids": g.prompt_ids, "response_ids": g.response_ids, "logprobs": g.logprobs,
            "loss_mask": g.loss_mask, "token_versions": g.token_versions,
            "prompt_text": prompt, "response_text": g.text,
        }
        for (input_id, traj, par), prompt, g in zip(meta, prompts, gens, strict=True)
    ]
    ctx.store.write_samples(agent, it, rows)
    tokens = sum(len(g.response_ids) for g in gens)
    resumed = [g for g in gens if g.token_versions is not None]
    # One batch decodes until its longest row ends: rows that finished early still take a
    # decode step each (the long tail's cost), counted here against the tokens kept.
    steps = max((len(g.response_ids) for g in gens), default=0)
    return StageResult(op, samples=len(rows), tokens=tokens, version=version, metrics={
        agent_key(agent, "response_tokens"): tokens / max(len(rows), 1),
        agent_key(agent, "rollout/decode_slots"): float(steps * len(gens)),
        agent_key(agent, "rollout/wasted_decode_slots"): float(steps * len(gens) - tokens),
        # Mixed batches: this op's share of the decodes run (1/ops of the one it joined) and
        # its rows decoded beside another agent's; summed per iteration (metrics.COUNTED).
        agent_key(agent, "rollout/decodes"): 1.0 / mix["ops"],
        agent_key(agent, "rollout/mixed_rows"): float(len(rows)) if mix["agents"] > 1 else 0.0,
        **({agent_key(agent, "rollout/pushed_weights"): 1.0} if pushed else {}),
        # The engine's own seconds prefilling and decoding in all (the prefill share's parts).
        **{agent_key(agent, f"rollout/{k}"): mix[k] for k in ("prefill_s", "generate_s") if k in mix},
        # Partial rollouts: rows that resumed under newer weights, and their tokens sampled so.
        **({agent_key(agent, "rollout/resumed_rows"): float(len(resumed)),
            agent_key(agent, "rollout/resumed_tokens"): float(sum(
                sum(v != g.version for v in g.token_versions) for g in resumed))} if resumed else {}),
    })
