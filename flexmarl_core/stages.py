"""The work of each node of the iteration graph, run inside a worker process.

Every stage takes ids (run folder, iteration, agent, micro-batch), reads what it needs from the
MEG Store, does its work with the engines/trainers kept in this process (`worker.context`) and
returns a small dict of measurements. Every stage is idempotent: a retry rewrites the same
store rows (deduplicated by sample id and policy version) or finds the work already done.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from flexmarl_core.worker import WorkerContext, context, publish_weights, trainer_state_path


class ConsistencyError(RuntimeError):
    """A sample would train a policy version other than the one that produced it."""


def stage_seed(*parts: object) -> int:
    """A seed that depends only on the node's identity, never on where or when it runs."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:4], "little")


def _worker_name() -> str:
    return os.environ.get("FLEXMARL_WORKER_NAME") or f"{socket.gethostname()}:{os.getpid()}"


class InjectedFault(RuntimeError):
    """A failure injected by a `raise@`/`fail@` marker (see `faults_dir`), never a real one."""


def faults_dir(run_dir: str | os.PathLike[str]) -> str:
    """Fault injection for tests and chaos drills: a marker file in this folder (next to the
    run folder, so starting the run does not wipe it) names the op (`<kind>@<op name>`) it
    hits as that op starts:

    - `kill@<op>`: the worker process SIGKILLs itself once (a real process death; Dask, not
      Prefect, reruns the op).
    - `raise@<op>`: the stage raises `InjectedFault` once (Prefect's task retries rerun it).
    - `fail@<op>`: the stage raises `InjectedFault` N times, N the file's integer content
      (empty: 1), one per attempt; N above the task's retries fails the op, hence the flow run.

    Each marker is consumed (removed, or decremented) before it fires, so the rerun goes through."""
    return os.fspath(run_dir).rstrip("/") + ".faults"


def _fault_point(run_dir: str, op_name: str) -> None:
    folder = faults_dir(run_dir)
    if not os.path.isdir(folder):  # the common case: one stat, no fault injection
        return
    kill = os.path.join(folder, f"kill@{op_name}")
    if os.path.exists(kill):
        os.remove(kill)
        os.kill(os.getpid(), signal.SIGKILL)
    once = os.path.join(folder, f"raise@{op_name}")
    if os.path.exists(once):
        os.remove(once)
        raise InjectedFault(f"injected fault (raise@) in {op_name}")
    counted = os.path.join(folder, f"fail@{op_name}")
    if os.path.exists(counted):
        text = open(counted).read().strip()
        left = int(text) if text else 1
        if left <= 1:
            os.remove(counted)
        else:  # replace, not rewrite in place: a reader never sees a torn count
            tmp = f"{counted}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(str(left - 1))
            os.replace(tmp, counted)
        if left >= 1:
            raise InjectedFault(f"injected fault (fail@, {left} left) in {op_name}")


def _measured(kind: str, fn: Callable[[], dict[str, Any]], run_dir: str = "", op_name: str = "") -> dict[str, Any]:
    if op_name:
        _fault_point(run_dir, op_name)
    t0, c0 = time.time(), time.process_time()
    out = fn()
    out.update(
        kind=kind, worker=_worker_name(), t_start=t0, t_end=time.time(),
        cpu_s=time.process_time() - c0,
    )
    return out


def weights_version(ctx: WorkerContext, agent: str, iteration: int) -> int:
    """One optimizer step per iteration: iteration k rolls out with version k (frozen: 0)."""
    return iteration if ctx.cfg.agent(agent).trainable else 0


# -- rollout ----------------------------------------------------------------------------------


def rollout(run_dir: str, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    name = f"rollout[{agent}]{f'@{turn}' if turn else ''} it={iteration} mb={mb}"
    return _measured("rollout", lambda: _rollout(context(run_dir), iteration, agent, turn, mb), run_dir, name)


def _rollout(ctx: WorkerContext, iteration: int, agent: str, turn: int, mb: int) -> dict[str, Any]:
    from flexmarl_core.meg import NodeKey, sample_id

    node = NodeKey(agent, turn)
    parents = ctx.meg.parents[node]
    inputs = ctx.inputs(iteration, mb)
    parent_text: dict[str, str] = {}
    for p in parents:
        tbl = ctx.store.read_samples(p.agent, iteration, mb=mb, columns=["sample_id", "response_text"])
        parent_text.update(zip(tbl.column("sample_id").to_pylist(), tbl.column("response_text").to_pylist(), strict=True))
    G = ctx.cfg.batch.group_size
    prompts, meta = [], []
    for inp in inputs:
        for traj in range(G):
            outs = {}
            for p in parents:
                sid = sample_id(inp["input_id"], traj, p.agent, p.turn)
                if sid not in parent_text:
                    raise RuntimeError(f"rollout[{agent}] it={iteration} mb={mb}: parent sample {sid} missing")
                outs[p.agent] = parent_text[sid]
            prompts.append(ctx.meg.render_prompt(agent, inp["text"], outs))
            meta.append((inp["input_id"], traj, tuple(sample_id(inp["input_id"], traj, p.agent, p.turn) for p in parents)))
    version = weights_version(ctx, agent, iteration)
    with ctx.lock:
        eng = ctx.engine(agent, version)
        gens = eng.generate(prompts, ctx.cfg.agent(agent).sampling, seed=stage_seed(ctx.cfg.seed, iteration, agent, turn, mb))
    rows = []
    for (input_id, traj, par), prompt, g in zip(meta, prompts, gens, strict=True):
        rows.append(
            {
                "sample_id": sample_id(input_id, traj, agent, turn),
                "input_id": input_id, "traj": traj, "turn": turn, "mb": mb,
                "policy_version": g.version, "parents": list(par),
                "prompt_ids": g.prompt_ids, "response_ids": g.response_ids, "logprobs": g.logprobs,
                "prompt_text": prompt, "response_text": g.text,
            }
        )
    ctx.store.write_samples(agent, iteration, rows)
    tokens = sum(len(g.response_ids) for g in gens)
    return {"agent": agent, "iteration": iteration, "mb": mb, "samples": len(rows), "tokens": tokens, "version": version}


# -- reward -----------------------------------------------------------------------------------


def reward(run_dir: str, iteration: int, mb: int) -> dict[str, Any]:
    return _measured("reward", lambda: _reward(context(run_dir), iteration, mb), run_dir, f"reward it={iteration} mb={mb}")


def _reward(ctx: WorkerContext, iteration: int, mb: int) -> dict[str, Any]:
    from flexmarl_core.workloads.api import Problem

    inputs = {r["input_id"]: r for r in ctx.inputs(iteration, mb)}
    # Each agent's output per trajectory is its last turn's response.
    samples: dict[str, list[dict[str, Any]]] = {}
    final: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
    for agent in ctx.meg.agent_names:
        rows = ctx.store.read_samples(agent, iteration, mb=mb, columns=["sample_id", "input_id", "traj", "turn", "policy_version", "response_text"]).to_pylist()
        samples[agent] = rows
        for r in sorted(rows, key=lambda r: r["turn"]):
            final[(r["input_id"], r["traj"])][agent] = r["response_text"]
    rewards: dict[tuple[str, int], dict[str, float]] = {}
    correct = []
    for (input_id, traj), outputs in final.items():
        inp = inputs[input_id]
        problem = Problem(input_id=input_id, text=inp["text"], answer=inp["answer"], meta=inp["meta"])
        rewards[(input_id, traj)] = ctx.workload.reward(problem, outputs)
        correct.append(float(ctx.workload.is_correct(problem, outputs)))
    mean_reward = {}
    for agent, rows in samples.items():
        status = [
            {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb,
             "reward": float(rewards[(r["input_id"], r["traj"])][agent])}
            for r in rows
        ]
        if ctx.cfg.agent(agent).trainable:
            ctx.store.write_status(agent, iteration, status)
        mean_reward[agent] = sum(s["reward"] for s in status) / max(len(status), 1)
    return {"iteration": iteration, "mb": mb, "reward": mean_reward, "accuracy": sum(correct) / max(len(correct), 1), "trajectories": len(correct)}


# -- training ---------------------------------------------------------------------------------


def _samples_per_step(ctx: WorkerContext, agent: str) -> int:
    turns = sum(1 for n in ctx.meg.nodes if n.agent == agent)
    return ctx.cfg.batch.inputs_per_iteration * ctx.cfg.batch.group_size * turns


def loss_scale(ctx: WorkerContext, agent: str) -> float:
    """1 / (samples per global batch x max new tokens): the loss is a token sum over a constant
    known from the config before any rollout (Dr. GRPO's normaliser), so early backward of a
    micro-batch is exact however the batch is split or ordered. A token-count normaliser would
    need every rollout of the batch before the first backward."""
    return 1.0 / (_samples_per_step(ctx, agent) * ctx.cfg.agent(agent).sampling.max_new_tokens)


def train(run_dir: str, iteration: int, agent: str, mb: int) -> dict[str, Any]:
    return _measured("train", lambda: _train(context(run_dir), iteration, agent, mb), run_dir,
                     f"train[{agent}] it={iteration} mb={mb}")


def _train(ctx: WorkerContext, iteration: int, agent: str, mb: int) -> dict[str, Any]:
    from flexmarl_core.algorithms import advantage_scope, compute_advantages
    from flexmarl_core.training import Sample

    tr, swap = ctx.trainer(agent, iteration)
    done = ctx.accumulated.setdefault(agent, set())
    if tr.version != iteration or (iteration, mb) in done:
        # A retry after the work was done (version moved on, or this micro-batch is in the grads).
        return {"agent": agent, "iteration": iteration, "mb": mb, "samples": 0, "skipped": True}
    alg = ctx.cfg.agent(agent).algorithm
    # Group-scoped estimators need only this micro-batch (whole groups); batch-scoped ones
    # (REINFORCE++) normalise over the iteration, whose rewards the plan waits for.
    whole = advantage_scope(alg.advantage) == "batch"
    # Consumed-or-not does not matter here: the trainer is still at `iteration`, so no update
    # has applied these samples yet; a `consumed_step` on them was written by an attempt whose
    # gradients died with its process (the version check above keeps this exactly-once).
    rows = ctx.store.ready(agent, iteration, need=("reward",), unconsumed=False,
                           mb=None if whole else mb).to_pylist()
    per_mb = _samples_per_step(ctx, agent) // ctx.cfg.batch.num_micro_batches
    expected = per_mb * (ctx.cfg.batch.num_micro_batches if whole else 1)
    if len(rows) != expected:
        raise RuntimeError(
            f"train[{agent}] it={iteration} mb={mb}: {len(rows)} samples ready, expected {expected}"
        )
    bad = [r["sample_id"] for r in rows if r["policy_version"] != tr.version]
    if bad:
        raise ConsistencyError(
            f"agent {agent!r} update {tr.version}: samples {bad[:3]} were not produced by policy "
            f"version {tr.version} (on-policy violated)"
        )
    rows.sort(key=lambda r: r["sample_id"])
    adv = compute_advantages(
        alg.advantage, [float(r["reward"]) for r in rows], [f"{r['input_id']}:{r['turn']}" for r in rows]
    ).tolist()
    mine = [(r, a) for r, a in zip(rows, adv, strict=True) if r["mb"] == mb]
    batch = [
        Sample(prompt_ids=r["prompt_ids"], response_ids=r["response_ids"], logprobs=r["logprobs"], advantage=a)
        for r, a in mine
    ]
    with ctx.lock:
        stats = tr.accumulate(batch, loss_scale=loss_scale(ctx, agent))
        done.add((iteration, mb))
    ctx.store.write_status(agent, iteration, [
        {"sample_id": r["sample_id"], "policy_version": r["policy_version"], "mb": mb,
         "advantage": a, "consumed_step": iteration}
        for r, a in mine
    ])
    return {"agent": agent, "iteration": iteration, "mb": mb, "samples": len(batch), **swap,
            **{f"train/{k}": float(v) for k, v in stats.items()}}


def step(run_dir: str, iteration: int, agent: str) -> dict[str, Any]:
    return _measured("step", lambda: _step(context(run_dir), iteration, agent), run_dir, f"step[{agent}] it={iteration}")


def _step(ctx: WorkerContext, iteration: int, agent: str) -> dict[str, Any]:
    if trainer_state_path(ctx.run_dir, agent, iteration + 1).exists():
        # An earlier attempt stepped and checkpointed (then died or was retried): take that state.
        tr, _ = ctx.trainer(agent, iteration + 1)
        return {"agent": agent, "iteration": iteration, "version": tr.version, "skipped": True}
    tr, _ = ctx.trainer(agent, iteration)
    done = ctx.accumulated.setdefault(agent, set())
    missing = [j for j in range(ctx.cfg.batch.num_micro_batches) if (iteration, j) not in done]
    # Micro-batches whose gradients died with another process (a killed worker, a trainer that
    # moved) are accumulated again from the store: same samples, same gradients.
    for j in missing:
        _train(ctx, iteration, agent, j)
    with ctx.lock:
        res = tr.step()
        done.clear()
        swap = ctx.checkpoint_trainer(agent)
    return {"agent": agent, "iteration": iteration, "version": res.version, **swap, "recomputed_mbs": len(missing),
            "train/grad_norm": res.grad_norm, **{f"train/{k}": v for k, v in res.metrics.items()}}


def sync(run_dir: str, iteration: int, agent: str) -> dict[str, Any]:
    return _measured("sync", lambda: _sync(context(run_dir), iteration, agent), run_dir, f"sync[{agent}] it={iteration}")


def _sync(ctx: WorkerContext, iteration: int, agent: str) -> dict[str, Any]:
    tr, _ = ctx.trainer(agent, iteration + 1)
    if tr.version != iteration + 1:
        raise ConsistencyError(f"sync[{agent}] it={iteration}: trainer is at version {tr.version}, expected {iteration + 1}")
    with ctx.lock:
        state = tr.weights()
        path = publish_weights(ctx.run_dir, agent, tr.version, state)
        eng = ctx.engines.get(agent)
        if eng is not None:  # an instance in this process takes the weights from memory
            eng.update_weights(state, tr.version)
    return {"agent": agent, "iteration": iteration, "version": tr.version, "bytes": path.stat().st_size}


STAGE_FNS: dict[str, Callable[..., dict[str, Any]]] = {
    "rollout": lambda run_dir, iteration, agent, turn, mb: rollout(run_dir, iteration, agent, turn, mb),
    "reward": lambda run_dir, iteration, agent, turn, mb: reward(run_dir, iteration, mb),
    "train": lambda run_dir, iteration, agent, turn, mb: train(run_dir, iteration, agent, mb),
    "step": lambda run_dir, iteration, agent, turn, mb: step(run_dir, iteration, agent),
    "sync": lambda run_dir, iteration, agent, turn, mb: sync(run_dir, iteration, agent),
}


def evaluate(run_dir: str, iteration: int) -> dict[str, Any]:
    """Greedy held-out accuracy of the team with the weights that iteration `iteration` uses
    (`iteration = train.iterations` evaluates the final weights)."""
    return _measured("evaluate", lambda: _evaluate(context(run_dir), iteration))


def _evaluate(ctx: WorkerContext, iteration: int) -> dict[str, Any]:
    from flexmarl_core.evaluate import evaluate_team

    problems = ctx.workload.problems("heldout", ctx.cfg.workload.heldout_size, seed=ctx.cfg.seed)
    with ctx.lock:
        engines = {a: ctx.engine(a, weights_version(ctx, a, iteration)) for a in ctx.meg.agent_names}
        res = evaluate_team(ctx.meg, ctx.workload, engines, problems, seed=ctx.cfg.seed)
    return {"iteration": iteration, "heldout_accuracy": res["accuracy"], "heldout_n": res["n"],
            **{f"heldout_reward/{a}": v for a, v in res["reward"].items()}}
