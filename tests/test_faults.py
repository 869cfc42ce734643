"""Faults on the real stack: a Dask worker process killed during a rollout and during a
training micro-step, and the whole training process killed (kill -9) and resumed. After each,
the store holds every sample exactly once and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from flexmarl_core.stages import faults_dir
from flexmarl_core.worker import weights_path
from storage import MEGStore

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
ITERATIONS = 2
COMMON = ["cluster.prefect_lean=true", "workload.reward=tests.reward_fns:varied", "workload.credit=team",
          f"train.iterations={ITERATIONS}", "train.evaluate=false"]


def _flow(overrides: list[str]):
    from flows.train import train

    return train(TINY, overrides, progress=False, return_state=True)


def assert_exactly_once(cfg) -> None:
    meg = MEG.from_config(cfg.team)
    store = MEGStore(cfg.resolved_store_uri())
    for it in range(cfg.train.iterations):
        ids = [p["input_id"] for p in store.read_inputs(it).to_pylist()]
        expected = {n.sample_id for n in meg.instantiate(ids, cfg.batch.group_size)}
        for agent in meg.agent_names:
            mine = [s for s in expected if s.split(":")[2] == agent]
            assert store.audit(agent, it, expected=mine) == [], (agent, it)
            tbl = store.read_samples(agent, it)
            assert sorted(tbl.column("sample_id").to_pylist()) == sorted(mine)
            assert tbl.column("consumed_step").null_count == 0


def assert_same_weights(cfg_a, cfg_b) -> None:
    for agent in MEG.from_config(cfg_a.team).trainable_agents:
        wa = load_file(str(weights_path(cfg_a.resolved_run_dir(), agent, ITERATIONS)))
        wb = load_file(str(weights_path(cfg_b.resolved_run_dir(), agent, ITERATIONS)))
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=f"{agent}.{k}")


@pytest.fixture(scope="module")
def baseline(prefect_api, dask_cluster, tmp_path_factory):
    """The uninterrupted run every fault run is compared with."""
    overrides = [f"run_dir={tmp_path_factory.mktemp('baseline')}/run", f"cluster.address={dask_cluster}", *COMMON]
    state = _flow(overrides)
    assert state.is_completed(), state.message
    return load_config(TINY, overrides)


@pytest.mark.parametrize("victim", ["rollout[solver] it=1 mb=0", "train[solver] it=1 mb=1"])
def test_worker_killed_mid_stage_run_completes_exactly_once(baseline, dask_cluster, tmp_path, victim):
    run_dir = tmp_path / "run"
    marker = Path(faults_dir(run_dir)) / f"kill@{victim}"
    marker.parent.mkdir(parents=True)
    marker.touch()
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *COMMON]
    state = _flow(overrides)
    assert state.is_completed(), state.message
    assert not marker.exists(), "the fault never fired"
    cfg = load_config(TINY, overrides)
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines()]
    if victim.startswith("train"):
        # mb=0's gradients died with the worker: the step accumulated them again from the store.
        step = next(o for o in ops if o["op"] == "step[solver] it=1")
        assert step["recomputed_mbs"] >= 1 or step.get("skipped"), step


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_kill_9_training_process_then_resume(baseline, prefect_api, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    sets = [x for o in [f"run_dir={run_dir}", *COMMON] for x in ("--set", o)]
    proc = _cli("train", TINY, *sets, "--no-progress", env=env)
    log = run_dir / "metrics" / "ops.jsonl"
    deadline = time.time() + 600
    try:
        # Kill in the middle of iteration 1: some of its training done, its steps not all done.
        while time.time() < deadline and proc.poll() is None:
            rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            if any(r["iteration"] == 1 and r["kind"] == "train" for r in rows):
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"run ended before the kill: {proc.stdout.read() if proc.stdout else ''}"
        os.killpg(proc.pid, signal.SIGKILL)  # the training process and its Dask workers
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done_before = [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]
    assert not all(f"step[{a}] it=1" in done_before for a in ("planner", "solver", "verifier")), \
        "killed too late: iteration 1 had already stepped"
    resumed = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    cfg = load_config(run_dir / "config.yaml")
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    # Completed ops were not run again: each op appears once in the op log across both attempts,
    # except training of an iteration whose step had not happened (its gradients were lost).
    names = [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]
    repeated = {n for n in names if names.count(n) > 1}
    assert all(n.startswith("train[") and " it=1 " in n + " " for n in repeated), repeated
    iterations = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in iterations] == list(range(ITERATIONS))


def test_resume_refuses_a_changed_config(tmp_path):
    from flexmarl_core import run

    cfg = load_config(TINY, [f"run_dir={tmp_path}/run", "train.iterations=1"])
    (tmp_path / "run").mkdir()
    with pytest.raises(run.ResumeError, match="no config.yaml"):
        run.check_resumable(cfg, tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text("name: other\n")
    with pytest.raises(run.ResumeError, match="config differs"):
        run.check_resumable(cfg, tmp_path / "run")
