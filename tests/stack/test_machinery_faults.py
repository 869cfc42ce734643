"""Faults of flexmarl's own machinery on the real stack (Prefect API, Dask workers, Parquet
store): a sandbox that cannot start programs stops the run at once, with an error that says
why, and nothing it touched is stored as a zero reward; an object store that cannot be reached
as configured is one error line naming the field, before anything is made."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from storage import MEGStore
from tests._runs import (
    COMMON,
    assert_exactly_once,
    assert_same_samples,
    assert_same_weights,
    flow,
    ops_log,
    plant_fault,
    read_op_task_runs,
)
from tests.unit.test_bad_input import TINY, _one_error_line, _train

REPO = Path(__file__).resolve().parents[2]
CODE = str(REPO / "configs" / "code_team.yaml")
SMALL = ["cluster.prefect_lean=true", "train.iterations=1", "train.evaluate=false",
         "train.warm_start=none", "workload.heldout_size=8", "batch.inputs_per_iteration=4",
         "batch.group_size=2", "batch.micro_batch_inputs=2"]


def test_a_sandbox_that_cannot_start_programs_stops_the_run(dask_cluster, tmp_path):
    """The code team's interpreter is unreachable: the first reward op raises `SandboxError`,
    is not retried (the next try would fail alike), and the run fails naming the sandbox and
    the interpreter. No reward was stored: a machinery failure is never a wrong answer."""
    from flows.train import train

    overrides = [f"run_dir={tmp_path / 'run'}", f"cluster.address={dask_cluster}", *SMALL,
                 "workload.params.python=/nonexistent/python3"]
    state = train(CODE, overrides, progress=False, return_state=True)
    assert state.is_failed(), state
    assert "cannot start programs" in state.message, state.message
    assert "/nonexistent/python3" in state.message and "reward it=0" in state.message, state.message
    # One attempt, no retry: the Prefect task run of the failed op ran once.
    failed_op = state.message.split("reward it=0 mb=", 1)[1].split()[0]
    runs = _task_runs_until(state.state_details.flow_run_id, f"reward it=0 mb={failed_op}",
                            lambda r: r.state.is_failed())
    assert runs and runs[0].state.is_failed() and runs[0].run_count == 1, runs
    cfg = load_config(CODE, overrides)
    store = MEGStore(cfg.resolved_store_uri())
    for agent in MEG.from_config(cfg.team).trainable_agents:
        rows = store.read_samples(agent, 0).to_pylist()
        assert rows, f"{agent}: the rollout ran, so its samples are stored"
        assert all(r["reward"] is None for r in rows), f"{agent}: a reward was stored"


def _task_runs_until(flow_run_id, name: str, done, timeout_s: float = 30.0) -> list:
    """The flow run's task runs named `name`, polled until `done(first)` (the server records
    task-run events in batches)."""
    from prefect import get_client

    async def read() -> list:
        async with get_client() as c:
            return await read_op_task_runs(c, flow_run_id)

    deadline = time.monotonic() + timeout_s
    while True:
        runs = [r for r in asyncio.run(read()) if r.name == name]
        if (runs and done(runs[0])) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


UNRESOLVABLE = "http://no-such-host.invalid:9000"


@pytest.mark.parametrize(("endpoint", "setting", "says"), [
    (UNRESOLVABLE, "store.uri=s3://bucket/x", "store.uri 's3://bucket/x': cannot reach it: "),
    (UNRESOLVABLE, "run_dir=s3://bucket/runs/x", "run_dir 's3://bucket/runs/x': cannot reach it: "),
    (None, "store.uri=ftp://host/x", "store.uri 'ftp://host/x': cannot reach it: Unrecognized filesystem"),
    ("moto", "store.uri=s3://no-bucket/x", "store.uri 's3://no-bucket/x': the bucket 'no-bucket' does not exist"),
], ids=["store-host", "run-dir-host", "store-scheme", "store-bucket"])
def test_an_unreachable_store_is_one_error_line_before_anything_is_made(
        request, tmp_path: Path, monkeypatch, endpoint: str | None, setting: str, says: str) -> None:
    if endpoint == "moto":
        endpoint = request.getfixturevalue("s3_server")
    if endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("FLEXMARL_CACHE", str(tmp_path / "cache"))
    line = _one_error_line(_train(tmp_path, str(TINY), "--set", setting), tmp_path)
    assert says in line, line
    assert not os.path.exists(tmp_path / "cache" / "scratch")  # no local scratch for a remote run


def test_deadlines_name_a_bad_kind_or_value() -> None:
    from flexmarl_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"unknown op kind\(s\) \['rolout'\]"):
        load_config(str(TINY), ["cluster.deadlines.per_kind_s={rolout: 5}"])
    with pytest.raises(ConfigError, match=r"deadline\(s\) of \['train'\] must be > 0"):
        load_config(str(TINY), ["cluster.deadlines.per_kind_s={train: 0}"])
    cfg = load_config(str(TINY), ["cluster.deadlines.per_kind_s={train: 30}"])
    assert cfg.cluster.deadlines.per_kind_s == {"train": 30} and cfg.cluster.deadlines.floor_s == 300


def _dask_processes(port: int, env: dict[str, str], log_dir: Path) -> list[subprocess.Popen]:
    """`dask scheduler` on `port` and two `dask worker`s, as a user starts them; returns once
    both workers joined."""
    from distributed import Client

    bin_dir = Path(sys.executable).parent

    def start(name: str, *cmd: str) -> subprocess.Popen:
        out = open(log_dir / f"{name}.log", "a")  # noqa: SIM115 - the process owns it
        return subprocess.Popen([str(bin_dir / "dask"), *cmd], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    address = f"tls://127.0.0.1:{port}"  # the certificates: Dask's TLS settings (`cluster_certs`)
    procs = [start("scheduler", "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port", str(port),
                   "--no-dashboard")]
    procs += [start(f"w{i}", "worker", address, "--name", f"w{i}", "--nthreads", "1",
                    "--resources", "rollout=1,train=1") for i in range(2)]
    try:
        with Client(address, timeout=60) as c:
            c.wait_for_workers(2, timeout=120)
    except BaseException:
        _kill(procs)
        raise
    return procs


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)


def test_scheduler_lost_mid_run_stops_clearly_and_resume_completes(baseline, prefect_api, cluster_certs, tmp_path):
    """The `dask scheduler` process of an external cluster is killed mid-iteration (while a
    rollout of iteration 1 is held): the run stops at once with an error that says what was
    lost and how to resume. With a scheduler and workers started again at the same address,
    `--resume` completes the run: every sample exactly once, the undisturbed run's weights."""
    import shutil

    from flexmarl_core.stages.faults import held_ops
    from flows.train import train

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": prefect_api,
           "OMP_NUM_THREADS": "1", "FLEXMARL_TORCH_THREADS": "1"}
    run_dir = tmp_path / "run"
    victim = "rollout[solver] it=1 mb=0"
    holds = plant_fault(run_dir, "hold", victim, "600").parent
    overrides = [f"run_dir={run_dir}", f"cluster.address=tls://127.0.0.1:{port}", *COMMON]
    procs = _dask_processes(port, env, tmp_path)
    killed = threading.Event()

    def kill_when_held() -> None:
        deadline = time.monotonic() + 600
        while victim not in held_ops(run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the scheduler only: its workers are left behind
        killed.set()

    watcher = threading.Thread(target=kill_when_held, daemon=True)
    watcher.start()
    try:
        state = flow(overrides)
        watcher.join(timeout=5)
        assert killed.is_set(), "the held rollout was never reached"
        assert state.is_failed(), state
        assert "SchedulerLostError: lost the Dask scheduler" in state.message, state.message
        assert f"flexmarl train --resume {run_dir}" in state.message, state.message
    finally:
        _kill(procs)
    done = [o["op"] for o in ops_log(run_dir)]
    assert victim not in done and any(o.startswith("step[") for o in done)  # stopped mid-run
    shutil.rmtree(holds)
    procs = _dask_processes(port, env, tmp_path)  # the user starts the cluster again
    try:
        resumed = train(str(run_dir / "config.yaml"), [], progress=False, resume=True, return_state=True)
        assert resumed.is_completed(), resumed.message
    finally:
        _kill(procs)
    cfg = load_config(str(run_dir / "config.yaml"))
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    assert_same_samples(baseline, cfg)
