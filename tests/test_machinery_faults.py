"""Faults of flexmarl's own machinery on the real stack (Prefect API, Dask workers, Parquet
store): a sandbox that cannot start programs stops the run at once, with an error that says
why, and nothing it touched is stored as a zero reward."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from storage import MEGStore

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
