"""Program teams on the real stack (Prefect flow, Dask workers, the endpoint in each worker):
a worker killed under a program op, the whole run killed and resumed, a program that fails on
some trajectories and one that fails on all. The store holds exactly what the program ops
committed, once, every sample trained on."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from flexmarl_core.cluster import workers_info
from flexmarl_core.config import load_config
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.programs.manifest import committed_ids, read_manifest
from flexmarl_core.stages import faults_dir
from flexmarl_core.workloads import make_workload
from storage import MEGStore
from tests._runs import kill_group_when, ops_log
from tests.stack.test_faults import _cli

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "program_team.yaml")
ITERATIONS = 2
SMALL = [f"train.iterations={ITERATIONS}", "train.warm_start=none", "train.evaluate=false",
         "train.evaluate_initial=false", "batch.inputs_per_iteration=4", "batch.group_size=2",
         "batch.micro_batch_inputs=2", "workload.heldout_size=8", "cluster.prefect_lean=true",
         "workload.reward=tests.reward_fns:varied", "workload.credit=team"]


def _flow(overrides: list[str]):
    from flows.train import train

    return train(CONFIG, overrides, progress=False, return_state=True)


def _ops(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]


def assert_committed_once(run_dir: Path) -> None:
    """Every agent's stored samples are exactly its manifests' ids, each trained on, and the
    audit finds nothing."""
    cfg = load_config(run_dir / "config.yaml")
    store, loc = MEGStore(cfg.resolved_store_uri()), cfg.run_location()
    for it in range(ITERATIONS):
        for a in cfg.team.agents:
            ids = committed_ids(loc, it, range(cfg.batch.num_micro_batches), a.name)
            tbl = store.read_samples(a.name, it, columns=["sample_id", "consumed_step"])
            assert sorted(tbl.column("sample_id").to_pylist()) == sorted(ids) and ids, (a.name, it)
            assert tbl.column("consumed_step").null_count == 0
    assert audit_run(str(run_dir))[1] == []


def test_worker_killed_under_a_program_op_reruns_it_whole(dask_cluster, tmp_path):
    run_dir = tmp_path / "run"
    marker = Path(faults_dir(run_dir)) / "kill@program it=1 mb=0"
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    state = _flow([f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *SMALL])
    assert state.is_completed(), state.message
    assert not marker.exists(), "the fault never fired"
    assert_committed_once(run_dir)
    ops = _ops(run_dir)
    assert sum(o["op"] == "program it=1 mb=0" for o in ops) == 1
    prog = [o for o in ops if o["kind"] == "program"]
    assert all(o["busy"] for o in prog)  # its decodes ran on the agents' instances
    assert {b[0] for o in prog for b in o["busy"]} <= {"w0", "w1"}
    assert all(o["team/program/requests_per_decode"] >= 1 for o in prog)


def _odd(text: str) -> bool:
    return int(next(c for c in text if c.isdigit())) % 2 == 1  # what half_fail fails on


def _mixed_seed(overrides: list[str]) -> int:
    """A seed whose every micro-batch holds a problem `half_fail` fails on and one it does not
    (computed from the workload, so the test does not bet on a draw)."""
    for seed in range(50):
        cfg = load_config(CONFIG, [*overrides, f"seed={seed}"])
        wl, n, per = make_workload(cfg.workload, cfg.team), cfg.batch.inputs_per_iteration, cfg.batch.micro_batch_inputs
        mbs = [[_odd(p.text) for p in wl.problems("train", n, seed=seed, offset=it * n)[k:k + per]]
               for it in range(ITERATIONS) for k in range(0, n, per)]
        if all(any(m) and not all(m) for m in mbs):
            return seed
    raise AssertionError("no seed in 0..49 mixes failing and passing problems in every micro-batch")


def test_trajectories_whose_program_fails_are_named_and_left_out(dask_cluster, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *SMALL,
                 "team.program=tests.program_teams:half_fail"]
    state = _flow([*overrides, f"seed={_mixed_seed(overrides)}"])
    assert state.is_completed(), state.message
    assert_committed_once(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    store = MEGStore(cfg.resolved_store_uri())
    for it in range(ITERATIONS):
        inputs = {r["input_id"]: r["text"] for r in store.read_inputs(it).to_pylist()}
        failed = [f for mb in range(2) for f in read_manifest(cfg.run_location(), it, mb)["failed"]]
        odd = {i for i, text in inputs.items() if _odd(text)}
        assert {f["input_id"] for f in failed} == odd and all("ValueError: cannot handle" in f["error"] for f in failed)
        solved = {r.split(":")[0] for r in store.read_samples("verifier", it).column("sample_id").to_pylist()}
        assert solved == set(inputs) - odd
    failed_ops = sum(o.get("team/program/failed", 0) for o in _ops(run_dir))
    assert failed_ops == sum(len(read_manifest(cfg.run_location(), it, mb)["failed"])
                             for it in range(ITERATIONS) for mb in range(2))


def test_a_program_failing_on_every_trajectory_stops_the_run_naming_it(dask_cluster, tmp_path):
    state = _flow([f"run_dir={tmp_path / 'run'}", f"cluster.address={dask_cluster}", *SMALL,
                   "team.program=tests.program_teams:always_fail"])
    assert state.is_failed()
    assert "every trajectory of team.program 'tests.program_teams:always_fail' failed" in state.message
    assert "RuntimeError: this program is broken" in state.message


def test_kill_9_mid_run_then_resume_completes_exactly_once(prefect_api, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    sets = [x for o in [f"run_dir={run_dir}", *SMALL] for x in ("--set", o)]
    log = run_dir / "metrics" / "ops.jsonl"
    # kill once iteration 1 has a committed program op but has not stepped
    kill_group_when(_cli("train", CONFIG, *sets, "--no-progress", env=env),
                    lambda: log.exists() and any(r["iteration"] == 1 and r["kind"] == "program" for r in ops_log(run_dir)))
    done = {json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()}
    assert not all(f"step[{a}] it=1" in done for a in ("planner", "solver", "verifier")), "killed too late"
    resumed = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    assert_committed_once(run_dir)
    names = [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]
    assert all(names.count(n) == 1 for n in names if n.startswith("program")), names


def test_an_agent_without_an_instance_for_a_moment_is_waited_for_then_named(monkeypatch):
    """Tags read mid-move can show an agent no instance: the dispatcher reads them afresh for
    `move_grace_s` and only then fails, naming the agent and the tag (a machinery error, so the
    op is retried, never a wrong answer)."""
    from flexmarl_core.cluster import plugins
    from flexmarl_core.programs.api import DecodeStats, MachineryError

    reads: list[float] = []

    def resources(client):
        reads.append(time.monotonic())
        return {"w0": {"rollout:planner": 1}, "w1": {"rollout:solver": 1, "train": 1}}

    monkeypatch.setattr(plugins, "worker_resources", resources)
    d = plugins.DaskDispatcher("run", client=None, tags_ttl_s=0.0, move_grace_s=0.6)
    with pytest.raises(MachineryError, match="agent 'verifier': no worker has resource tag 'rollout:verifier'"):
        d.decode("verifier", 0, [], DecodeStats())
    assert len(reads) >= 3 and reads[-1] - reads[0] >= 0.5  # it looked again, for the grace period


def test_equally_loaded_instances_decode_where_the_program_op_runs(monkeypatch):
    """Two program ops on two workers that both serve every agent (`rollout` tags): each op's
    decodes go to its own worker, not both to the first one by name (a real in-process Dask
    cluster; the decode itself is replaced by one that says where it ran)."""
    import distributed

    from flexmarl_core.cluster import plugins
    from flexmarl_core.programs.api import DecodeStats

    def where(run_uri, agent, version, groups):
        return distributed.get_worker().address, DecodeStats()

    monkeypatch.setattr(plugins, "decode_on_instance", where)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, resources={"rollout": 1},
                                  dashboard_address=None) as lc, distributed.Client(lc) as client:
        addrs = sorted(workers_info(client))
        for home in addrs:
            d = plugins.DaskDispatcher("run", client, home=home)
            assert d.capacity("planner") == 2
            assert d.decode("planner", 0, [], DecodeStats()) == home
