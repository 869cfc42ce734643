"""Secrets reach the workers and are written nowhere: a random canary is planted in the CLI's
environment and in a Prefect Secret block, `flexmarl train` runs the tiny team for one
iteration on a local cluster whose `cluster.worker_env` references both (`${env:...}`,
`${secret:...}`), and a reward function fails the run unless each worker holds both values
(it knows only their sha256 digests). Then neither canary may appear in any file of the run
folder (bytes: config copy, op log, manifests, TensorBoard events, Dask logs), in the CLI's
output, in what the Prefect API holds for the run (flow runs' parameters and names, task runs,
logs) or anywhere in the Prefect server's SQLite database: Prefect stores block documents
encrypted (Fernet), so not even the Secret block itself is in clear there. Slow tier: it
starts its own local cluster, which is what `worker_env` applies to.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.leftovers import RECORD
from tests._runs import open_runs_under, read_op_task_runs
from tests.reward_fns import CANARY_DIGESTS_ENV

REPO = Path(__file__).resolve().parents[2]
FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))
TINY = str(REPO / "configs" / "tiny.yaml")
BLOCK = "flexmarl-canary"
ENV_NAME = "FLEXMARL_CANARY_ENV"
WORKER_ENV = (f"cluster.worker_env={{FLEXMARL_CANARY_A: '${{env:{ENV_NAME}}}', "
              f"FLEXMARL_CANARY_B: '${{secret:{BLOCK}}}'}}")
ONE_ITERATION = ["train.iterations=1", "train.evaluate=false", "workload.credit=team",
                 "workload.reward=tests.reward_fns:canaries_delivered"]


def _train(tmp: Path, env: dict[str, str], *sets: str, timeout: float = 600) -> subprocess.CompletedProcess:
    args = [x for kv in (f"run_dir={tmp / 'run'}", *sets) for x in ("--set", kv)]
    return subprocess.run([FLEXMARL, "train", TINY, "--no-progress", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp, env=env)


def _child_env(prefect_api: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO), **extra}
    env.pop("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", None)
    return env


def _sqlite_files() -> list[Path]:
    """The harness server's database and its journal files (what a leak would sit in)."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    assert url and url.startswith("sqlite"), url
    db = Path(url.split(":///", 1)[1])
    assert db.is_file(), db
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal")) if p.is_file()]


async def _api_records(flow_run_id: str) -> dict[str, str]:
    """What the API holds for the run, as JSON text: its flow runs (the training run's and its
    iterations': parameters, names, tags, states), their task runs and their logs."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    async with get_client() as c:
        kids = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        runs = [await c.read_flow_run(flow_run_id), *kids]
        ids = [r.id for r in runs]
        tasks = await read_op_task_runs(c, flow_run_id)
        own = await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=200)
        logs: list = []
        while batch := await c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)),
                                         limit=200, offset=len(logs)):
            logs += batch
    return {"flow runs": "\n".join(r.model_dump_json() for r in runs),
            "task runs": "\n".join(t.model_dump_json() for t in [*tasks, *own]),
            "logs": "\n".join(x.model_dump_json() for x in logs)}


@pytest.fixture(scope="module")
def canary_run(prefect_api: str, tmp_path_factory: pytest.TempPathFactory):
    from prefect.blocks.system import Secret

    canaries = (f"canary-env-{secrets.token_hex(16)}", f"canary-secret-{secrets.token_hex(16)}")
    Secret(value=canaries[1]).save(BLOCK, overwrite=True)
    tmp = tmp_path_factory.mktemp("canary")
    digests = " ".join(hashlib.sha256(c.encode()).hexdigest() for c in canaries)
    env = _child_env(prefect_api, **{ENV_NAME: canaries[0], CANARY_DIGESTS_ENV: digests})
    res = _train(tmp, env, WORKER_ENV, *ONE_ITERATION)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]  # the reward found both in its worker
    attempts = json.loads((tmp / "run" / RECORD).read_text())["attempts"]  # tasks/leftovers.py
    return tmp, res, canaries, attempts[-1]["flow_run"]


def _leaks(text: bytes, canaries: tuple[str, str]) -> list[str]:
    return [c for c in canaries if c.encode() in text]


def test_the_run_folder_holds_references_and_no_secret(canary_run) -> None:
    tmp, _, canaries, _ = canary_run
    run = tmp / "run"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700  # the folder flexmarl made: its owner's only
    assert stat.S_IMODE((run / "store").stat().st_mode) == 0o700
    config = (run / "config.yaml").read_text()
    assert f"${{env:{ENV_NAME}}}" in config and f"${{secret:{BLOCK}}}" in config  # kept as written
    files = [p for p in tmp.rglob("*") if p.is_file()]  # the run folder and anything beside it
    names = {p.name for p in files}
    assert any(n.startswith("events.out.tfevents") for n in names), sorted(names)  # TensorBoard
    assert {"dask-w0.log", "dask-w1.log", "ops.jsonl", "provenance.json"} <= names, sorted(names)
    leaked = {str(p.relative_to(tmp)): hit for p in files if (hit := _leaks(p.read_bytes(), canaries))}
    assert not leaked, leaked


def test_the_terminal_shows_no_secret(canary_run) -> None:
    _, res, canaries, _ = canary_run
    assert not _leaks((res.stdout + res.stderr).encode(), canaries)


def test_the_prefect_api_and_its_database_hold_no_secret(canary_run) -> None:
    _, _, canaries, flow_run_id = canary_run
    # Task runs are recorded from events in batches: wait until the API holds the run's end.
    assert open_runs_under(flow_run_id, patience_s=120) == []
    records = asyncio.run(_api_records(flow_run_id))
    assert f"secret:{BLOCK}" in records["flow runs"]  # the parameters carry the reference text
    assert records["task runs"] and records["logs"]
    leaked = {what: hit for what, text in records.items() if (hit := _leaks(text.encode(), canaries))}
    assert not leaked, leaked
    # Everything the server stored (runs, events, logs, artifacts, blocks), in clear or not.
    stored = {p.name: p.read_bytes() for p in _sqlite_files()}
    everything = b"".join(stored.values())
    # The scan reads what it should: the run's parameters are there in clear, and so is the
    # Secret block's document (its name; its value is encrypted).
    assert f"secret:{BLOCK}".encode() in everything and BLOCK.encode() in everything
    leaked = {name: hit for name, data in stored.items() if (hit := _leaks(data, canaries))}
    assert not leaked, leaked


def test_a_missing_secret_block_is_one_line_and_no_run_folder(prefect_api: str, tmp_path: Path) -> None:
    env = _child_env(prefect_api)
    res = _train(tmp_path, env, "cluster.worker_env={TOKEN: '${secret:flexmarl-no-such-block}'}",
                 *ONE_ITERATION, timeout=300)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "cluster.worker_env.TOKEN: ${secret:flexmarl-no-such-block} names no Prefect Secret block" in lines[0]
    assert not (tmp_path / "run").exists()
