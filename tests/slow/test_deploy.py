"""prefect.yaml as an operator uses it (docs/operations.md, "Run it as a service"), against a real local
server: create the work pool, `prefect --no-prompt deploy --all`, start a process worker, run
the on-demand training deployment with a tiny config and then the evaluation deployment on that
run, each to Completed.

Everything runs in subprocesses with a private PREFECT_HOME and API, so neither the session's
test harness nor the user's ~/.prefect is touched. Takes ~1-2 min on 2 cores.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from flexmarl_core.runtime.worker import weights_path
from storage import MEGStore

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))
POOL = "flexmarl-local"  # the work pool prefect.yaml names
ITERATIONS = 1



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, api: str) -> dict[str, str]:
    """The operator's shell: the venv's Python, a private Prefect home and API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api,
        # The worker checks for scheduled runs every 10 s by default; 1 s keeps the test short.
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_SERVER_LOGGING_LEVEL="WARNING",
        # The flow-run subprocess imports this checkout's packages (the venv may be another
        # checkout's editable install).
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    return env


def _stop(proc: subprocess.Popen) -> None:
    """End a process, its process group and every descendant (flow runs, Dask workers):
    the process worker may start flow runs in sessions of their own."""
    try:
        family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        family = [proc.pid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in family:
            try:
                os.killpg(pid, sig) if pid == proc.pid else os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=10)
            if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                       for p in family):
                return
        except (subprocess.TimeoutExpired, psutil.NoSuchProcess):
            pass


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A real `prefect server start` on a free port, private home; (api url, env)."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _env(home, api)
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed after the server stops
    proc = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=server_env,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120  # healthy after ~10 s on an idle box, much longer under load
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield api, env
    finally:
        _stop(proc)
        log.close()


def _prefect(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _flow_runs(api: str, deployment: str) -> list[dict]:
    deps = httpx.post(f"{api}/deployments/filter", json={
        "deployments": {"name": {"any_": [deployment]}}}).json()
    assert len(deps) == 1, deps
    return httpx.post(f"{api}/flow_runs/filter", json={
        "flow_runs": {"deployment_id": {"any_": [deps[0]["id"]]}}}).json()


def test_deploy_train_and_evaluate_on_a_process_worker(prefect_server, tmp_path: Path) -> None:
    api, env = prefect_server
    res = _prefect(env, "work-pool", "create", POOL, "--type", "process")
    assert res.returncode == 0, res.stdout + res.stderr

    res = _prefect(env, "--no-prompt", "deploy", "--all")
    assert res.returncode == 0, res.stdout + res.stderr
    deps = {d["name"]: d for d in httpx.post(f"{api}/deployments/filter", json={}).json()}
    assert {"train-nightly", "train-on-demand", "evaluate"} <= set(deps)
    assert all(d["work_pool_name"] == POOL for d in deps.values())
    nightly = deps["train-nightly"]["schedules"]
    assert [s["schedule"].get("cron") for s in nightly] == ["0 2 * * *"]
    # The pull step runs every flow from the directory deploy ran in (relative paths work).
    assert str(REPO) in str(deps["train-on-demand"]["pull_steps"])

    worker_log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", POOL, "--type", "process"],
        cwd=REPO, env=env, stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        run_dir = tmp_path / "run"
        overrides = (f'["run_dir={run_dir}", "train.iterations={ITERATIONS}", '
                     '"train.evaluate=false"]')
        res = _prefect(env, "deployment", "run", "flexmarl-train/train-on-demand",
                       "--param", "config=configs/tiny.yaml", "--param", f"overrides={overrides}",
                       "--watch", "--watch-timeout", "400", timeout=450)
        detail = res.stdout + res.stderr + (tmp_path / "worker.log").read_text()[-4000:]
        assert res.returncode == 0, detail
        [train_run] = _flow_runs(api, "train-on-demand")
        assert train_run["state_type"] == "COMPLETED", detail
        assert train_run["parameters"]["config"] == "configs/tiny.yaml"
        # The run really trained: final weights of every agent and samples in the store.
        for agent in ("planner", "solver", "verifier"):
            assert weights_path(run_dir, agent, ITERATIONS).is_file(), agent
        assert MEGStore(str(run_dir / "store"), create=False).read_samples("solver", 0).num_rows
        # Every expected sample of the completed iteration is stored exactly once.
        res = subprocess.run([FLEXMARL, "store", "audit", str(run_dir)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "0 error(s)" in res.stdout, res.stdout + res.stderr

        res = _prefect(env, "deployment", "run", "flexmarl-evaluate/evaluate",
                       "--param", f"run_dir={run_dir}", "--watch", "--watch-timeout", "300",
                       timeout=350)
        detail = res.stdout + res.stderr + (tmp_path / "worker.log").read_text()[-4000:]
        assert res.returncode == 0, detail
        [eval_run] = _flow_runs(api, "evaluate")
        assert eval_run["state_type"] == "COMPLETED", detail
        arts = httpx.post(f"{api}/artifacts/filter", json={
            "artifacts": {"key": {"any_": ["arith-tiny-evaluation"]}}}).json()
        assert len(arts) == 1 and arts[0]["flow_run_id"] == eval_run["id"], arts
        assert f"iteration {ITERATIONS}" in arts[0]["data"] and "accuracy:" in arts[0]["data"]

        # An evaluation of weights the run never published fails, naming what is missing.
        res = _prefect(env, "deployment", "run", "flexmarl-evaluate/evaluate",
                       "--param", f"run_dir={run_dir}", "--param", "iteration=7",
                       "--watch", "--watch-timeout", "120", timeout=150)
        assert res.returncode == 1
        failed = [r for r in _flow_runs(api, "evaluate") if r["id"] != eval_run["id"]]
        assert [r["state_type"] for r in failed] == ["FAILED"]
        assert "no weights for iteration 7" in failed[0]["state"]["message"]

        # A lost fragment of a completed iteration (the run compacted it into one): the audit
        # names the missing samples.
        part = run_dir / "store" / "samples" / "agent=verifier" / "iteration=0"
        (frag,) = part.glob("*.parquet")
        frag.unlink()
        res = subprocess.run([FLEXMARL, "store", "audit", str(run_dir)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 1, res.stdout + res.stderr
        missing = next(ln for ln in res.stdout.splitlines() if " missing " in ln)
        assert missing.startswith("ERROR") and str(part) in missing and ":verifier:" in missing
    finally:
        _stop(worker)
        worker_log.close()
