"""PPO with a critic through the real stack (Prefect flow, Dask workers, Parquet store): the
critic's ops are task runs of their own, it is placed on a training slot each iteration and its
checkpoint swaps into another process, a critic op that fails for good is resumed from the op
log with the undisturbed run's weights (agents' and critic's), the exactly-once audit covers the
critic's values, and per-agent critics run alike."""

from __future__ import annotations

import asyncio
import json

import torch
from safetensors.torch import load_file

from flexmarl_core.config import load_config
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.runfiles.location import RunLocation
from flexmarl_core.runtime.worker import WorkerContext, weights_path
from flexmarl_core.teams import team_shape
from tests._runs import (
    COMMON,
    ITERATIONS,
    TINY,
    assert_exactly_once,
    assert_same_weights,
    flow_run,
    ops_log,
    plant_fault,
    task_runs,
)

GAE = [f"team.agents.{a}.algorithm.advantage=gae" for a in ("planner", "solver", "verifier")]


def _run(tmp_path, name, dask_cluster, extra=(), retries=0):
    from flows.train import train

    overrides = [f"run_dir={tmp_path / name}", f"cluster.address={dask_cluster}", *COMMON, *GAE, *extra]
    state = train.with_options(retries=retries)(TINY, overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message
    return load_config(TINY, overrides), state


def _iterations(cfg):
    path = cfg.resolved_run_dir() / "metrics" / "iterations.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_gae_run_resumes_a_failed_critic_op_to_the_same_weights(prefect_api, dask_cluster, tmp_path):
    base, state = _run(tmp_path, "base", dask_cluster)
    names = {r.name for r in asyncio.run(task_runs(state.state_details.flow_run_id))}
    assert {"value[critic] it=0 mb=0", "train[critic] it=1 mb=1", "step[critic] it=1",
            "sync[critic] it=1"} <= names, sorted(n for n in names if "critic" in n)
    assert audit_run(base.resolved_run_dir())[1] == []
    rows = _iterations(base)
    for agent in ("planner", "solver", "verifier"):
        assert all(f"agent/{agent}/value_loss" in r and f"agent/{agent}/explained_var" in r for r in rows)
    assert all(r["agent/critic/train/grad_norm"] > 0 for r in rows)
    # placed like an agent's trainer: a training slot per iteration (on-demand allocation)
    slots = [json.loads(x) for x in (base.resolved_run_dir() / "metrics" / "decisions.jsonl").read_text().splitlines()]
    assert sorted(d["iteration"] for d in slots if d["decision"] == "train_slot" and d["agent"] == "critic") \
        == list(range(ITERATIONS))
    # checkpointed like one: another process swaps the critic's last state in, and it holds
    # exactly the weights the critic's last sync published
    fresh = WorkerContext(loc=RunLocation(base.resolved_run_dir()), cfg=base, team=team_shape(base))
    tr, swap = fresh.trainer("critic", ITERATIONS)
    assert tr.version == ITERATIONS and swap["swap_in_bytes"] > 0
    published = load_file(str(weights_path(base.resolved_run_dir(), "critic", ITERATIONS)))
    assert all(torch.equal(v, published[k]) for k, v in tr.weights().items())

    victim = "train[critic] it=1 mb=0"
    marker = plant_fault(tmp_path / "hurt", "fail", victim, "2")  # 1 try + 1 task retry, both fail
    hurt, state = _run(tmp_path, "hurt", dask_cluster, retries=1)
    assert not marker.exists(), "the fault never fired"
    fr, _ = asyncio.run(flow_run(state.state_details.flow_run_id))
    assert fr.run_count == 2, fr.run_count  # the flow failed once, and its retry resumed
    assert_exactly_once(hurt)
    assert audit_run(hurt.resolved_run_dir())[1] == []
    assert_same_weights(base, hurt)
    wa = load_file(str(weights_path(base.resolved_run_dir(), "critic", ITERATIONS)))
    wb = load_file(str(weights_path(hurt.resolved_run_dir(), "critic", ITERATIONS)))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=f"critic.{k}")
    # iteration 0's critic ops were done before the failure and not run again
    done_first = [o["op"] for o in ops_log(hurt.resolved_run_dir()) if o["op"] == "value[critic] it=0 mb=0"]
    assert len(done_first) == 1, done_first


def test_per_agent_critics_run_and_audit(prefect_api, dask_cluster, tmp_path):
    cfg, _ = _run(tmp_path, "per", dask_cluster, ["critic.shared=false"])
    assert audit_run(cfg.resolved_run_dir())[1] == []
    ops = {o["op"] for o in ops_log(cfg.resolved_run_dir())}
    for agent in ("planner", "solver", "verifier"):
        assert weights_path(cfg.resolved_run_dir(), f"critic-{agent}", ITERATIONS).is_file()
        assert f"value[critic-{agent}] it=1 mb=1" in ops
    rows = _iterations(cfg)
    assert all(r[f"agent/critic-{a}/train/grad_norm"] > 0 for r in rows for a in ("planner", "solver", "verifier"))
