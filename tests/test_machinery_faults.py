"""Faults of flexmarl's own machinery on the real stack (Prefect API, Dask workers, Parquet
store): a sandbox that cannot start programs stops the run at once, with an error that says
why, and nothing it touched is stored as a zero reward; an object store that cannot be reached
as configured is one error line naming the field, before anything is made."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from storage import MEGStore
from tests.test_bad_input import TINY, _one_error_line, _train

REPO = Path(__file__).resolve().parents[1]
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
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list:
        async with get_client() as c:
            return await c.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)

    deadline = time.monotonic() + timeout_s
    while True:
        runs = [r for r in asyncio.run(read()) if r.name == name]
        if (runs and done(runs[0])) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


UNRESOLVABLE = "http://no-such-host.invalid:9000"


@pytest.mark.slow  # the CLI's preflight in a subprocess
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
