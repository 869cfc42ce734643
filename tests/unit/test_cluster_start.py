"""How a launch's local cluster starts: ahead of the launch's own imports and checks, taken over
by the run, stopped again when no run takes it; its workers forked from one process that
imported torch and transformers once (`flexmarl_core/cluster/workers.py`)."""

from __future__ import annotations

import os
import time

import psutil

from flexmarl_core.cluster import workers
from flexmarl_core.config import ClusterConfig

ONE = ClusterConfig.model_validate({"workers": [{"name": "w0", "resources": {"rollout": 1, "train": 1}}],
                                    "worker_env": {"FLEXMARL_TEST_MARK": "ahead"}})
#: no `worker_env`: its workers fork from the forkserver
PLAIN = ClusterConfig.model_validate({"workers": [{"name": "w0", "resources": {"rollout": 1, "train": 1}}]})


def _origin() -> tuple[int, list[str], bool, str | None]:
    import sys

    me = psutil.Process()
    return (me.ppid(), me.parent().cmdline(), "torch" in sys.modules, os.environ.get("FLEXMARL_TEST_MARK"))


def _forked_workers() -> set[int]:
    """The processes the forkserver of this process has forked, now."""
    servers = [p for p in psutil.Process().children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    return {c.pid for s in servers for c in s.children()}


def test_a_cluster_started_ahead_is_the_one_the_run_takes_and_its_workers_fork_from_one_import(monkeypatch):
    monkeypatch.setenv("FLEXMARL_TEST_MARK", "inherited")
    workers.start_ahead(PLAIN)
    started = next(iter(workers._AHEAD.values()))
    with workers.cluster_for(PLAIN) as client:
        assert workers._AHEAD == {}  # taken over, not started again
        assert client is started.result()[1]
        (ppid, parent, torch_loaded, mark), = client.run(_origin).values()
    assert ppid != os.getpid() and "multiprocessing.forkserver" in " ".join(parent), parent
    assert "torch" in " ".join(parent) and torch_loaded  # the server imported it, the worker has it
    assert mark == "inherited"  # this process's environment of the moment reaches a forked worker


def test_a_cluster_no_run_took_is_stopped_with_nothing_left_running():
    before = _forked_workers()
    workers.start_ahead(PLAIN)
    assert list(workers._AHEAD) == [PLAIN.model_dump_json()]
    workers.close_ahead()
    assert workers._AHEAD == {}
    deadline = time.monotonic() + 60
    while _forked_workers() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _forked_workers() - before == set()


def test_not_ahead_for_a_scheduler_address_or_a_secret_in_the_cluster_settings():
    workers.start_ahead(ClusterConfig(address="tls://127.0.0.1:1"))
    workers.start_ahead(ClusterConfig.model_validate({"worker_env": {"TOKEN": "${secret:hub-token}"}}))
    assert workers._AHEAD == {}


def test_a_cluster_started_for_other_settings_is_stopped_before_the_runs_own_starts():
    """The flow loads the config again; should its layout differ (the cores looked at anew), the
    cluster started ahead is not the run's: it stops before the run's starts, not at the end."""
    before = _forked_workers()
    workers.start_ahead(PLAIN)
    other = PLAIN.model_copy(update={"torch_threads": 2})
    with workers.cluster_for(other) as client:
        assert workers._AHEAD == {}
        assert list(client.run(os.getenv, "FLEXMARL_TORCH_THREADS").values()) == ["2"]  # the run's settings
        deadline = time.monotonic() + 60  # the stopped one's exit is reaped by the forkserver
        while len(_forked_workers() - before) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_forked_workers() - before) == 1  # the run's one worker, not the other's


def test_starting_a_cluster_leaves_this_process_its_threads_and_worker_env_starts_fresh():
    """Dask sets OMP_NUM_THREADS=1 in the starting process's own environment unless told not
    to: a cluster started ahead would have cut the driver's torch (a warm start's SFT) to one
    thread. A `cluster.worker_env` (libgomp and glibc read theirs as they load) makes the
    workers start fresh instead of forking from the server that loaded them."""
    import multiprocessing

    before = os.environ.get("OMP_NUM_THREADS")
    with workers.cluster_for(ONE) as client:  # ONE sets a worker_env
        assert os.environ.get("OMP_NUM_THREADS") == before
        (ppid, parent, _, mark), = client.run(_origin).values()
        assert "multiprocessing.forkserver" not in " ".join(parent) and mark == "ahead"
        assert list(client.run(os.getenv, "OMP_NUM_THREADS").values()) == [str(ONE.torch_threads)]
    if "forkserver" in multiprocessing.get_all_start_methods():
        with workers.cluster_for(PLAIN) as client:
            (ppid, parent, _, _), = client.run(_origin).values()
            assert "multiprocessing.forkserver" in " ".join(parent)
            assert os.environ.get("OMP_NUM_THREADS") == before
