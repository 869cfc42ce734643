"""The Prefect API away mid-run, on the real stack: away for a minute and back, training goes
on and every op's task run completes afterwards; left dead, the run finishes, says so in one
line and its process exits (about a minute after its last op: `tasks/api_watch.py`). Minutes
of waiting by design, so in the slow tier (the rest of the machinery's faults:
tests/stack/test_machinery_faults.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from flexmarl_core.config import load_config
from tests._runs import (
    COMMON,
    TINY,
    assert_exactly_once,
    assert_same_samples,
    assert_same_weights,
    ops_log,
    plant_fault,
    read_op_task_runs,
)

REPO = Path(__file__).resolve().parents[2]


#: how long the Prefect API server is away (the outage the operations guide promises to ride out)
OUTAGE_S = 60.0


def test_api_server_away_for_a_minute_mid_run_training_goes_on(baseline, tmp_path):
    """The Prefect API server is killed in iteration 0 and started again `OUTAGE_S` later.
    Training goes on meanwhile (ops finish during the outage), the run completes with the
    undisturbed run's samples and weights, and afterwards the API holds a completed task run
    for every op: the reports were buffered and sent once the API was back."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import start_server, stop_server
    from flexmarl_core.stages.faults import held_ops, release

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path / "prefect"
    api = f"http://127.0.0.1:{port}/api"
    run_dir = tmp_path / "run"
    victim = "rollout[solver] it=0 mb=1"
    plant_fault(run_dir, "hold", victim, "600")
    # The tiny run ends within the outage, which the server's restart stretches past 60 s: the
    # run's end waits longer than its default budget for a silent API, so nothing is given up.
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "PYTHONPATH": str(REPO),
           "FLEXMARL_API_GIVE_UP_S": str(OUTAGE_S + 240)}
    assert start_server(home, port) == api
    sets = [x for o in [f"run_dir={run_dir}", *COMMON] for x in ("--set", o)]
    proc = subprocess.Popen([sys.executable, "-m", "flexmarl.cli", "train", str(TINY), *sets, "--no-progress"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while victim not in held_ops(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert victim in held_ops(run_dir), "the held rollout was never reached"
        stop_server(home, signal.SIGKILL)
        away = time.time()
        release(run_dir, victim)
        time.sleep(OUTAGE_S)
        back = time.time()
        assert start_server(home, port) == api  # the same port: the run's API URL
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        ops = ops_log(run_dir)
        assert any(away < o["finished"] < back for o in ops), "no op finished while the API was away"
        cfg = load_config(str(run_dir / "config.yaml"))
        assert_exactly_once(cfg)
        assert_same_weights(baseline, cfg)
        assert_same_samples(baseline, cfg)

        async def completed() -> set[str]:
            async with get_client() as c:
                # the server's own database: this run and its iterations' nested runs only
                (run,) = [r for r in await c.read_flow_runs() if r.parent_task_run_id is None]
                assert run.state.is_completed(), run.state
                runs = await read_op_task_runs(c, run.id)
                return {r.name for r in runs if r.state.is_completed()}

        want = {o["op"] for o in ops}
        deadline = time.monotonic() + 60
        # start_server put its server's auth string in this process's environment
        auth = os.environ["PREFECT_API_AUTH_STRING"]
        with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
            while not want <= (got := asyncio.run(completed())) and time.monotonic() < deadline:
                time.sleep(1)
        assert want <= got, sorted(want - got)[:10]
    finally:
        stop_server(home, signal.SIGKILL)


def test_api_server_left_dead_mid_run_the_run_finishes_and_says_so_in_one_line(tmp_path):
    """The Prefect API server is killed in iteration 0 and never comes back. Training goes on
    (it needs no API); once the run's budget for a silent API is spent (set to 15 s here: the
    default 60 s is the same code path, and `bench/chaos_operator.py` times it), its end figures
    are made without task runs, the flow's own end is tried once, and the CLI prints the
    summary and one line saying the UI misses the run's end, exits 0, and the terminal shows no
    traceback. The run's attempt record says it completed, for the command that ends its flow
    run once an API is back."""
    from flexmarl.prefect_api import start_server, stop_server
    from flexmarl_core.driver.audit import audit_run
    from flexmarl_core.stages.faults import held_ops, release

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path / "prefect"
    api = f"http://127.0.0.1:{port}/api"
    run_dir = tmp_path / "run"
    victim = "rollout[solver] it=0 mb=1"
    plant_fault(run_dir, "hold", victim, "600")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_CLIENT_MAX_RETRIES"}
    env.update(PREFECT_API_URL=api, PREFECT_HOME=str(home), PYTHONPATH=str(REPO), FLEXMARL_API_GIVE_UP_S="15")
    assert start_server(home, port) == api
    sets = [x for o in [f"run_dir={run_dir}", *COMMON] for x in ("--set", o)]
    proc = subprocess.Popen([sys.executable, "-m", "flexmarl.cli", "train", str(TINY), *sets, "--no-progress"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while victim not in held_ops(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert victim in held_ops(run_dir), "the held rollout was never reached"
        stop_server(home, signal.SIGKILL)
        release(run_dir, victim)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    lines = [x for x in out.splitlines() if x.strip()]
    said = [x for x in lines if "Prefect API" in x]
    assert len(said) == 1 and "the run finished" in said[0] and api in said[0], lines
    assert not any("Traceback" in x or "may be lost" in x for x in lines), lines
    assert any("held-out" in x or "E2E" in x for x in lines)  # the summary, as after any run
    assert audit_run(str(run_dir)).verdict() == "clean"
    (attempt,) = json.loads((run_dir / "prefect-runs.json").read_text())["attempts"]
    assert attempt["ended"] == "COMPLETED" and not attempt["closed"], attempt
