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


def _origin() -> tuple[int, list[str], bool, str | None]:
    import sys

    me = psutil.Process()
    return (me.ppid(), me.parent().cmdline(), "torch" in sys.modules, os.environ.get("FLEXMARL_TEST_MARK"))


def _forked_workers() -> set[int]:
    """The processes the forkserver of this process has forked, now."""
    servers = [p for p in psutil.Process().children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    return {c.pid for s in servers for c in s.children()}


def test_a_cluster_started_ahead_is_the_one_the_run_takes_and_its_workers_fork_from_one_import():
    workers.start_ahead(ONE)
    started = next(iter(workers._AHEAD.values()))
    with workers.cluster_for(ONE) as client:
        assert not workers._AHEAD  # taken over, not started again
        assert client is started.result()[1]
        (ppid, parent, torch_loaded, mark), = client.run(_origin).values()
    assert ppid != os.getpid() and "multiprocessing.forkserver" in " ".join(parent), parent
    assert "torch" in " ".join(parent) and torch_loaded  # the server imported it, the worker has it
    assert mark == "ahead"  # the config's worker_env reaches a forked worker


def test_a_cluster_no_run_took_is_stopped_with_nothing_left_running():
    before = _forked_workers()
    workers.start_ahead(ONE)
    workers.close_ahead()
    assert not workers._AHEAD
    deadline = time.monotonic() + 60
    while _forked_workers() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (_forked_workers() - before)


def test_not_ahead_for_a_scheduler_address_or_a_secret_in_the_cluster_settings():
    workers.start_ahead(ClusterConfig(address="tls://127.0.0.1:1"))
    workers.start_ahead(ClusterConfig.model_validate({"worker_env": {"TOKEN": "${secret:hub-token}"}}))
    assert not workers._AHEAD


def test_a_cluster_started_for_other_settings_is_stopped_before_the_runs_own_starts():
    """The flow loads the config again; should its layout differ (the cores looked at anew), the
    cluster started ahead is not the run's: it stops before the run's starts, not at the end."""
    before = _forked_workers()
    workers.start_ahead(ONE)
    other = ONE.model_copy(update={"torch_threads": 2})
    with workers.cluster_for(other) as client:
        assert not workers._AHEAD
        assert client.run(os.getenv, "FLEXMARL_TORCH_THREADS") and set(
            client.run(os.getenv, "FLEXMARL_TORCH_THREADS").values()) == {"2"}
        deadline = time.monotonic() + 60  # the stopped one's exit is reaped by the forkserver
        while len(_forked_workers() - before) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_forked_workers() - before) == 1  # the run's one worker, not the other's
