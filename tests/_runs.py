"""Runs of the tiny team on the real stack that fault tests compare: the undisturbed run's
settings (`COMMON`), the flow, fault markers, and the checks that a disturbed run stored every
sample exactly once and ended with the undisturbed run's samples and weights."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from flexmarl_core.meg import MEG
from flexmarl_core.runtime.worker import weights_path
from flexmarl_core.stages import faults_dir
from storage import MEGStore

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
ITERATIONS = 2
COMMON = ["cluster.prefect_lean=true", "workload.reward=tests.reward_fns:varied", "workload.credit=team",
          f"train.iterations={ITERATIONS}", "train.evaluate=false"]


def flow(overrides: list[str]):
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


def assert_same_samples(cfg_a, cfg_b) -> None:
    """Same tokens sampled for every agent and iteration (seeds depend on the op, not the run)."""
    a, b = MEGStore(cfg_a.resolved_store_uri()), MEGStore(cfg_b.resolved_store_uri())
    for it in range(ITERATIONS):
        for agent in MEG.from_config(cfg_a.team).agent_names:
            ta, tb = (s.read_samples(agent, it).select(["sample_id", "response_ids"]).sort_by("sample_id")
                      for s in (a, b))
            assert ta.num_rows == tb.num_rows > 0, (agent, it)
            assert ta.to_pylist() == tb.to_pylist(), (agent, it)


async def read_op_task_runs(client, flow_run_id) -> list:
    """The op task runs of a training flow run: those of its iterations' nested flow runs
    (`tasks/iteration_runs.py`) and its own (a flat run's, or reports whose iteration's flow run
    the API never made), not the iterations' own task runs in it."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
    )

    children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    flt = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id, *(c.id for c in children)]))
    runs: list = []
    while batch := await client.read_task_runs(flow_run_filter=flt, limit=200, offset=len(runs)):
        runs += batch
    from tasks.iteration_runs import TRACKING_KEY

    return [r for r in runs if r.task_key != TRACKING_KEY]


def open_runs_under(flow_run_id, patience_s: float = 30.0) -> list[str]:
    """The flow runs and task runs under a training flow run (itself, its iterations' flow
    runs, their task runs) that are not final, as `kind name state` lines; [] once the API
    holds none (the server records task runs from events in batches: polled briefly)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
    )

    async def read() -> list[str]:
        async with get_client() as c:
            kids = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
            runs = [await c.read_flow_run(flow_run_id), *kids]
            flt = FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs]))
            tasks: list = []
            while batch := await c.read_task_runs(flow_run_filter=flt, limit=200, offset=len(tasks)):
                tasks += batch
        return [f"{kind} {r.name} {r.state.name if r.state else None}" for kind, rs in (("flow run", runs),
                ("task run", tasks)) for r in rs if r.state is None or not r.state.is_final()]

    deadline = time.monotonic() + patience_s
    while (left := asyncio.run(read())) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


async def task_runs(flow_run_id):
    from prefect import get_client

    async with get_client() as c:
        return await read_op_task_runs(c, flow_run_id)


async def flow_run(flow_run_id):
    from prefect import get_client

    async with get_client() as c:
        return await c.read_flow_run(flow_run_id), await c.read_flow_run_states(flow_run_id)


def ops_log(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]


def plant_fault(run_dir: Path, kind: str, victim: str, content: str = "") -> Path:
    """A `<kind>@<victim>` marker beside the run folder (see `stages.faults_dir`)."""
    marker = Path(faults_dir(run_dir)) / f"{kind}@{victim}"
    marker.parent.mkdir(parents=True)
    marker.write_text(content)
    return marker


def kill_group_when(proc: subprocess.Popen, ready: Callable[[], bool], limit_s: float = 600.0) -> None:
    """Once `ready()` (or after `limit_s`), SIGKILL `proc`'s process group: the training
    process and its Dask workers. Fails if the run ended first."""
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.1)
        assert proc.poll() is None, f"the run ended before the kill: {proc.stdout.read() if proc.stdout else ''}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)



def train_on_threads(cfg, host_of: Callable | None = None):
    """`cfg`'s run through the real stages on the in-process ThreadExecutor: (run folder,
    result). `host_of(team)`: a program host to install for the run (a scripted model behind
    the dispatcher seam), taken out again afterwards."""
    from flexmarl_core.driver import run
    from flexmarl_core.programs import engines
    from flexmarl_core.runtime.worker import context
    from flexmarl_core.sim.threads import ThreadExecutor, stage_fn

    folder = run.prepare_run(cfg, log=lambda _: None)
    ex = ThreadExecutor(stage_fn(str(folder)), {w.name: dict(w.resources) for w in cfg.cluster.workers})
    if host_of is not None:
        engines.install_host(host_of(context(str(folder)).team))
    try:
        return folder, run.train(cfg, folder, ex)
    finally:
        if host_of is not None:
            engines._HOST.clear()
        ex.close()
