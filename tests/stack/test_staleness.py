"""Bounded staleness (`codesign.max_staleness: k`): the plan lets rollouts run k iterations
ahead, training refuses samples older than k, `decoupled_ppo` corrects for the gap; and a LoRA
team with k = 1 through the real run (Prefect flow, Dask workers, MEG Store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flexmarl_core.algorithms.losses import POLICY_LOSSES, clipped, decoupled_ppo
from flexmarl_core.config import AlgorithmConfig, ConfigError, load_config
from flexmarl_core.ops import Op
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.stages.registry import ConsistencyError
from flexmarl_core.trainers.policy import check_staleness

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
OFF_POLICY = [f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in ("planner", "solver", "verifier")]


def _plan(*overrides: str) -> Plan:
    cfg = load_config(TINY, ["train.iterations=4", *overrides])
    return Plan.build(cfg)


def test_k0_plan_is_the_on_policy_plan_and_k1_gates_on_the_sync_before():
    on = _plan()
    assert Op(2, "sync", "solver") in on.deps[Op(3, "rollout", "solver", 0, 0)]
    k1 = _plan("codesign.max_staleness=1", *OFF_POLICY)
    assert set(k1.deps) == set(on.deps)  # same work, other waits
    d = k1.deps[Op(3, "rollout", "solver", 0, 0)]
    assert Op(1, "sync", "solver") in d and Op(2, "sync", "solver") not in d
    assert not any(op.kind == "sync" for op in k1.deps[Op(1, "rollout", "solver", 0, 0)])
    assert Op(2, "step", "solver") in k1.deps[Op(3, "train", "solver", mb=1)]
    # Off the async pipeline: the gate is every agent's sync, still k iterations back.
    sync_k2 = _plan("codesign.max_staleness=2", "codesign.async_pipeline=false", *OFF_POLICY)
    assert {op for op in sync_k2.deps[Op(3, "rollout", "planner", 0, 0)] if op.kind == "sync"} == {
        Op(0, "sync", a) for a in ("planner", "solver", "verifier")}


def test_a_sample_older_than_k_is_refused_naming_agent_and_versions():
    rows = [{"sample_id": "i0:0:solver:0", "policy_version": 5}, {"sample_id": "i0:1:solver:0", "policy_version": 3}]
    check_staleness("solver", 5, rows, k=2)  # 5 - 3 = 2: allowed
    with pytest.raises(ConsistencyError, match=r"agent 'solver' update 6: .*i0:1:solver:0.*\[3\].*\[4, 6\].*max_staleness=2"):
        check_staleness("solver", 6, rows, k=2)
    with pytest.raises(ConsistencyError, match="on-policy violated"):
        check_staleness("solver", 5, rows, k=0)
    with pytest.raises(ConsistencyError, match=r"\[5\]"):  # a sample from the future
        check_staleness("solver", 4, rows[:1], k=2)


def test_staleness_needs_an_off_policy_loss():
    with pytest.raises(ConfigError, match=r"max_staleness=1: agent 'planner' uses policy_loss 'clipped'"):
        load_config(TINY, ["codesign.max_staleness=1"])
    assert POLICY_LOSSES.info("decoupled_ppo")["off_policy"] and not POLICY_LOSSES.info("clipped")["off_policy"]


def _grad(fn, logp0, old, adv, mask, cfg):
    logp = logp0.clone().requires_grad_(True)
    loss, m = fn(logp, old, adv, mask, cfg=cfg)
    loss.backward()
    return logp.grad, m


def test_decoupled_ppo_is_clipped_on_policy_and_truncates_stale_weights():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen) * 3
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    adv = torch.tensor([1.0, -0.5, 2.0])
    cfg = AlgorithmConfig(is_cap=2.0)
    # On-policy (behaviour = current weights): the same gradient as the clipped loss.
    g_dec, m = _grad(decoupled_ppo, logp, logp, adv, mask, cfg)
    g_clip, _ = _grad(clipped, logp, logp, adv, mask, cfg)
    assert torch.allclose(g_dec, g_clip, atol=1e-7, rtol=0)  # fp32 ops on O(1) values
    assert float(m["is_weight"]) == pytest.approx(float(mask.sum()))
    # Stale: behaviour logprobs 0.3 nats above (w = e^-0.3) and one 2 nats below (w capped at 2).
    old = logp + 0.3
    old[0, 0] = logp[0, 0] - 2.0
    g_st, m = _grad(decoupled_ppo, logp, old, adv, mask, cfg)
    w = torch.exp(logp - old).clamp(max=2.0)
    # The gradient of -A * w * logp per token (the ratio to the proximal policy is 1).
    assert torch.allclose(g_st, -(adv[:, None] * w) * mask, atol=1e-6, rtol=0)
    assert float(m["is_trunc_frac"]) == 1.0


def test_lora_team_with_staleness_through_the_prefect_flow_on_dask(prefect_api, dask_cluster, tmp_path):
    from safetensors.torch import load_file

    from flows.train import train
    from storage import MEGStore

    run_dir = tmp_path / "run"
    lora = "{base: tiny-1m, lora: {rank: 4}}"
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", "cluster.prefect_lean=true",
                 "train.iterations=3", "train.evaluate=false", "codesign.max_staleness=1", *OFF_POLICY,
                 *[f"team.agents.{a}.model={lora}" for a in ("planner", "solver", "verifier")]]
    state = train(TINY, overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message
    # One base for the team; what syncs publish is an adapter (no base tensor in it).
    assert len(list((run_dir / "bases").glob("*.safetensors"))) == 1
    published = load_file(str(run_dir / "weights" / "solver" / "v3.safetensors"))
    assert published and all(".lora_A." in k or ".lora_B." in k for k in published)
    store = MEGStore(str(run_dir / "store"))
    for it in range(3):
        versions = set(store.read_samples("solver", it, columns=["policy_version"]).column("policy_version").to_pylist())
        assert versions and versions <= {it - 1, it} - {-1}, (it, versions)
    # Where a step goes: rollouts at most k = 1 iteration ahead of training, the samples' mean
    # staleness within it, prefill a part of each agent's decoding on the shared base engine.
    rows = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["pipeline/queue_bound"] == 1 and r["pipeline/queue_depth"] in (0, 1), r
        for a in ("planner", "solver", "verifier"):
            assert 0 <= r[f"agent/{a}/staleness"] <= 1 and 0 < r[f"agent/{a}/rollout/prefill_share"] < 1
    assert 0 <= state.result()["summary"]["where_a_step_goes"]["pipeline/queue_depth"] <= 1


def test_lora_staleness_between_checkpoints_matches_checkpointing_every_step(prefect_api, tmp_path):
    """One worker process with `train.checkpoint_every=2`: adapters between checkpoints come from
    the trainer in memory (no weight file), and the run ends where the every-step run does."""
    from safetensors.torch import load_file

    from flows.train import train

    lora = "{base: tiny-1m, lora: {rank: 4}}"
    common = ["cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}]", "cluster.prefect_lean=true",
              "train.iterations=3", "train.evaluate=false", "codesign.max_staleness=1", *OFF_POLICY,
              *[f"team.agents.{a}.model={lora}" for a in ("planner", "solver", "verifier")]]
    for every in (1, 2):
        state = train(TINY, [f"run_dir={tmp_path}/e{every}", f"train.checkpoint_every={every}", *common],
                      progress=False, return_state=True)
        assert state.is_completed(), state.message
    assert not (tmp_path / "e2" / "weights" / "solver" / "v1.safetensors").exists()
    for a in ("planner", "solver", "verifier"):
        want = load_file(str(tmp_path / "e1" / "weights" / a / "v3.safetensors"))
        got = load_file(str(tmp_path / "e2" / "weights" / a / "v3.safetensors"))
        # Same samples in the same order through the same fp32 ops in one process: equal bits.
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), a


def test_partial_rollouts_need_staleness_and_refuse_a_shared_decode():
    with pytest.raises(ConfigError, match="partial_rollouts=true has no effect with max_staleness=0"):
        load_config(TINY, ["codesign.partial_rollouts=true"])
    lora = "{base: tiny-1m, lora: {rank: 4}}"
    with pytest.raises(ConfigError, match="no trainable agent rolls out on the HF engine without model.lora"):
        load_config(TINY, ["codesign.partial_rollouts=true", "codesign.max_staleness=1", *OFF_POLICY,
                           *[f"team.agents.{a}.model={lora}" for a in ("planner", "solver", "verifier")]])
    stale = ["codesign.max_staleness=1", *OFF_POLICY]
    rows = [{"sample_id": "s", "policy_version": 1, "token_versions": [1, 1, 3]}]
    with pytest.raises(ConsistencyError, match=r"policy version\(s\) \[1, 3\]"):
        check_staleness("solver", 2, rows, 1)  # its last token from weights newer than the update's
    assert load_config(TINY, ["codesign.partial_rollouts=true", *stale]).codesign.partial_rollouts


PARTIAL = ["cluster.prefect_lean=true", "train.iterations=2", "train.evaluate=false",
           "codesign.max_staleness=1", "codesign.partial_rollouts=true", "codesign.load_balancing=false",
           "team.agents.planner.sampling={temperature: 1.0, max_new_tokens: 40, stop: []}",
           # The planner's rollouts on a worker of their own, one at a time (its one tag); its
           # second thread runs what may go anywhere (a reward): a rollout held mid-decode until
           # the sync publishes never holds up a reward that the sync's training waits for.
           "cluster.workers=[{name: w0, nthreads: 2, resources: {'rollout:planner': 1}}, "
           "{name: w1, resources: {rollout: 1, train: 1}}]",
           *OFF_POLICY]
DECODE, SYNC0 = "rollout[planner] it=1 mb=0 decode", "sync[planner] it=0"


def test_a_partial_rollout_resumes_under_the_weights_a_sync_publishes(prefect_api, tmp_path):
    """The real run (Prefect flow, local Dask cluster, MEG Store) with k = 1 and partial
    rollouts. The planner's rollout of iteration 1 starts on version 0 and is held mid-decode
    (its first look for newer weights) until the planner's sync of iteration 0 has published
    version 1 (that sync is itself held until the rollout is mid-decode). Its rows keep
    version 0 for the tokens before and version 1 for the tokens after; the run completes,
    audited exactly-once."""
    import json

    from flexmarl_core.runfiles.location import weights_key
    from flexmarl_core.stages.faults import held_ops
    from flows.train import train
    from storage import MEGStore
    from tests._holds import Holds

    run_dir = tmp_path / "run"
    decode, sync = DECODE, SYNC0
    overrides = [f"run_dir={run_dir}", *PARTIAL]
    published = run_dir / weights_key("planner", 1)
    with Holds(run_dir, [sync], lambda _: decode in held_ops(run_dir)) as hold_sync, \
            Holds(run_dir, [decode], lambda _: published.exists()) as hold_decode:
        state = train(TINY, overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message
    assert hold_sync.seen == {sync} and hold_decode.seen == {decode}
    rows = MEGStore(str(run_dir / "store")).read_samples("planner", 1, mb=0).to_pylist()
    assert rows and {r["policy_version"] for r in rows} == {0}
    spans = [r for r in rows if len(r["response_ids"]) > 16]
    assert spans, "no planner row decoded past its first look for newer weights"
    for r in rows:
        n = len(r["response_ids"])
        assert r["token_versions"] == ([0] * 16 + [1] * (n - 16) if n > 16 else None), r["sample_id"]
    its = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    assert its[1]["agent/planner/rollout/resumed_rows"] == len(spans)


def test_resume_with_a_partial_rollout_in_flight(prefect_api, tmp_path):
    """kill -9 of the training process (and its Dask workers) while the planner's rollout of
    iteration 1 is mid-decode and newer weights are published; `flexmarl train --resume` reruns
    that rollout whole, on the newest weights: its rows are written once, by the rerun, and
    the run audits exactly-once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from flexmarl_core.runfiles.location import weights_key
    from flexmarl_core.stages.faults import faults_dir, held_ops
    from storage import MEGStore
    from tests._holds import Holds
    from tests._runs import assert_exactly_once, ops_log

    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", *PARTIAL]
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}

    def cli(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    published = run_dir / weights_key("planner", 1)
    folder = Path(faults_dir(run_dir))
    folder.mkdir(parents=True)
    (folder / f"hold@{DECODE}").write_text("600")  # held until the kill
    proc = cli("train", TINY, *[x for o in overrides for x in ("--set", o)], "--no-progress")
    try:
        # The hold's own limit is the test's wait: in a suite beside a busy core on a slower
        # 2-core machine the run once took past the default 300 s to reach both holds.
        with Holds(run_dir, [SYNC0], lambda _: DECODE in held_ops(run_dir), limit_s=600) as hold_sync:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and proc.poll() is None:
                if published.exists() and DECODE in held_ops(run_dir):
                    break
                time.sleep(0.1)
        assert hold_sync.seen == {SYNC0}
        assert proc.poll() is None and published.exists(), "the run ended or never published version 1"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    victim = DECODE.removesuffix(" decode")
    assert victim not in {o["op"] for o in ops_log(run_dir)}
    for marker in folder.iterdir():
        marker.unlink()
    resumed = cli("train", "--resume", str(run_dir), "--no-progress")
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    assert [o["op"] for o in ops_log(run_dir)].count(victim) == 1
    rows = MEGStore(str(run_dir / "store")).read_samples("planner", 1, mb=0).to_pylist()
    assert rows and all(r["policy_version"] == 1 and r["token_versions"] is None for r in rows)
    assert_exactly_once(load_config(TINY, overrides))
