"""Adapts the core to a Dask cluster: the only package of `flexmarl_core` that imports Dask.

- `start_cluster` starts a local cluster whose worker processes carry their own resource tags,
  or connects to a scheduler address; `worker_resources` / `set_worker_resources` read and
  re-tag workers at run time (`workers.py`).
- `DaskExecutor` runs the orchestrator's ops as plain Dask tasks; the Prefect executor in
  `tasks/` is this one plus the task runs it reports to Prefect (`executor.py`).
- Worker plugins give the core's workers what only Dask can: weight pushes, the program host,
  shipped code (`plugins.py`).

Each name loads its module on first use: `flexmarl cluster certs` needs `security.py`, and a
launch starts its cluster (`workers.py`) while its own imports run, without the executor's
torch and transformers (seconds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_core.runtime.startup import lazy_names

if TYPE_CHECKING:
    from flexmarl_core.cluster.executor import DaskExecutor
    from flexmarl_core.cluster.plugins import (
        SKIP_DIRS,
        DaskDispatcher,
        DaskProgramHost,
        DaskPrograms,
        DaskWeightPushes,
        push_key,
        upload_code,
        zip_code,
    )
    from flexmarl_core.cluster.workers import (
        CONNECT_TIMEOUT_S,
        LOST_WORKER_ERRORS,
        MEMORY_RESTART_TOPIC,
        NO_WORKERS_TIMEOUT,
        RUNTIME_MODULES,
        LogFiles,
        WorkerLeftError,
        check_address,
        check_worker_tags,
        cluster_for,
        log_to_files,
        lost_worker,
        memory_restarts,
        set_worker_resources,
        start_cluster,
        warm_up,
        worker_cpu_s,
        worker_names,
        worker_resources,
        workers_info,
    )

__all__ = [
    "CONNECT_TIMEOUT_S",
    "DaskDispatcher",
    "DaskExecutor",
    "DaskProgramHost",
    "DaskPrograms",
    "DaskWeightPushes",
    "LOST_WORKER_ERRORS",
    "LogFiles",
    "MEMORY_RESTART_TOPIC",
    "NO_WORKERS_TIMEOUT",
    "RUNTIME_MODULES",
    "SKIP_DIRS",
    "WorkerLeftError",
    "check_address",
    "check_worker_tags",
    "cluster_for",
    "log_to_files",
    "lost_worker",
    "memory_restarts",
    "push_key",
    "set_worker_resources",
    "start_cluster",
    "upload_code",
    "warm_up",
    "worker_cpu_s",
    "worker_names",
    "worker_resources",
    "workers_info",
    "zip_code",
]

#: the module each name lives in, where not the cluster's own `workers`
_HOME = {"DaskExecutor": "executor",
         **dict.fromkeys(("SKIP_DIRS", "DaskDispatcher", "DaskProgramHost", "DaskPrograms", "DaskWeightPushes",
                          "push_key", "upload_code", "zip_code"), "plugins")}
__getattr__ = lazy_names(__name__, {name: _HOME.get(name, "workers") for name in __all__})
