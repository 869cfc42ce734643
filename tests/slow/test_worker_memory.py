"""A worker that Dask restarts for memory is reported as that: the op, the agent, the limit.

Real stack without Prefect: a local Dask cluster whose Nanny really restarts a worker that
crosses 95% of its memory limit (the `hog@` fault makes a rollout allocate until it does).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.ops import Op
from flexmarl_core.orchestrator.loop import WorkerMemoryError
from flexmarl_core.stages import faults_dir

REPO = Path(__file__).resolve().parents[2]


def test_memory_restart_names_op_agent_and_limit(tmp_path, monkeypatch):
    from flexmarl_core import cluster
    from flexmarl_core.cluster import workers
    from flexmarl_core.driver import run

    # The op comes back to the orchestrator once its worker has left (`DaskExecutor` gives back
    # ops pinned to a worker that left), and the error names the memory restart once the
    # Nanny's event is recorded (else a resubmit hogs and restarts again). Dask's no-workers
    # timeout is the backstop: 60 s, should it fire, leaves a loaded machine room to restart
    # the worker process (torch, transformers; once longer than the product's 15 s).
    monkeypatch.setattr(workers, "NO_WORKERS_TIMEOUT", "60s")

    one_worker = ("cluster.workers=[{name: w0, memory_limit: 1GiB, "
                  "resources: {rollout: 1, train: 1}}]")
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"run_dir={tmp_path}/run", "train.iterations=1", "train.evaluate=false", one_worker])
    run_dir = run.prepare_run(cfg)
    victim = Op(0, "rollout", "planner", 0, 0).name
    marker = Path(faults_dir(run_dir)) / f"hog@{victim}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    t0 = time.time()
    with cluster.cluster_for(cfg.cluster) as client:
        ex = cluster.DaskExecutor(client, str(run_dir))
        with pytest.raises(WorkerMemoryError) as info:
            run.train(cfg, run_dir, ex)
        restarts = cluster.memory_restarts(client, t0)
    msg = str(info.value)
    # Both planner micro-batches run on w0's threads when it is restarted: the error names the
    # one the orchestrator collects first, either is an op that died with the worker.
    died = [Op(0, "rollout", "planner", 0, mb).name for mb in range(cfg.batch.num_micro_batches)]
    assert victim in died and any(n in msg for n in died) and "agent 'planner'" in msg, msg
    assert "memory limit 1.00 GiB" in msg and "worker w0" in msg, msg
    assert "valid worker" not in msg
    assert restarts and all(r.worker == "w0" and r.limit == 1 << 30 for r in restarts)
    # The Nanny restarts above 95% of the limit: the reported RSS is past that line.
    assert all(r.rss > 0.95 * r.limit for r in restarts)


def _hang() -> None:
    import threading

    threading.Event().wait(300)


def test_a_worker_restarted_twice_within_the_lost_worker_timeout_comes_back():
    """Dask's `SpecCluster` closes a worker's Nanny for good when, `lost-worker-timeout` after
    one removal of the worker, no worker of that name is registered. A worker restarted, then
    restarted again while an op hangs on it (its Nanny waits ~4 s before killing it), is away
    at that instant: the run lost that worker for good. Here the timeout is 2 s, so the second,
    slow restart spans it; the worker must come back."""
    import dask

    from flexmarl_core.cluster import start_cluster, workers_info
    from flexmarl_core.config import ClusterConfig

    cfg = ClusterConfig.model_validate({"workers": [{"name": "w0", "resources": {"rollout": 1, "train": 1}}]})
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "2s"}):
        cluster, client = start_cluster(cfg, dashboard=False)
        try:
            first = next(iter(workers_info(client)))
            client.restart_workers([first], timeout=120)
            second = next(iter(workers_info(client)))
            hung = client.submit(_hang, workers=[second], pure=False)
            deadline = time.monotonic() + 120
            while second not in {a for a, keys in client.processing().items() if keys}:
                assert time.monotonic() < deadline, "the hanging op never started"
                time.sleep(0.05)
            client.restart_workers([second], timeout=60, raise_for_error=False)
            time.sleep(3)  # past the 2 s after the second removal too
            client.wait_for_workers(1, timeout=30)
            (back, info), = workers_info(client).items()
            assert back not in (first, second) and info["name"] == "w0"
            assert list(cluster.workers) == ["w0"]
            hung.cancel()
        finally:
            client.close()
            cluster.close()
