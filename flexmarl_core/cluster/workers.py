"""The Dask cluster itself: starting a local one whose workers carry their own resource tags
(`DaskTaskRunner(cluster_kwargs=...)` would give every worker the same ones) or connecting to a
scheduler address, checking what a config asks of it, re-tagging workers at run time (how the
load balancer moves an inference instance between agents), their names, CPU and logs, and
which of their errors mean a worker was lost.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dask
import distributed
from distributed import Client, Nanny, Scheduler, SpecCluster, WorkerPlugin
from distributed.comm.addressing import parse_address, parse_host_port
from distributed.deploy.cluster import Cluster
from distributed.utils import get_mp_context

from flexmarl_core.cluster.security import cluster_security
from flexmarl_core.config import ClusterConfig, ConfigError, ExperimentConfig
from flexmarl_core.config.secrets import resolve_map
from flexmarl_core.control.tags import ROLLOUT_TAG, TRAIN_TAG, is_rollout_tag, rollout_tag
from flexmarl_core.ops import MEMORY_ENV, MemoryRestart
from flexmarl_core.runtime.startup import freeze_imports

# A task whose tag no worker has would otherwise wait forever, with no error and no Prefect
# task run (Dask's default; seen with distributed 2026.8). The orchestrator
# checks tags before it submits, and `DaskExecutor` gives back a task pinned to a worker that
# left (a restarted worker comes back at a new address) within a second; this is the backstop.
NO_WORKERS_TIMEOUT = "15s"


class WorkerLeftError(RuntimeError):
    """The worker an op was pinned to left the cluster before the op ended (`DaskExecutor`)."""


#: Errors that mean a task's worker died or vanished, not that the task failed.
LOST_WORKER_ERRORS: tuple[type[BaseException], ...] = (
    WorkerLeftError,
    distributed.scheduler.KilledWorker,
    distributed.scheduler.NoValidWorkerError,
    distributed.scheduler.NoWorkerError,  # none running: a restarted worker not back yet
    distributed.client.FutureCancelledError,
    distributed.comm.core.CommClosedError,
)


def lost_worker(exc: BaseException) -> bool:
    return isinstance(exc, LOST_WORKER_ERRORS)


#: The topic under which a Nanny logs a worker it restarted for crossing its memory limit
#: (distributed's NannyMemoryManager: at `distributed.worker.memory.terminate`, 95%).
MEMORY_RESTART_TOPIC = "worker-restart-memory"
#: Name and memory limit of every worker address seen (a restarted worker comes back at a new
#: address, so the dead one's name must be remembered to report it).
_SEEN: dict[str, tuple[str, int]] = {}


def _note_workers(info: dict[str, Any]) -> None:
    for addr, w in info.items():
        _SEEN[addr] = (str(w.get("name", addr)), int(w.get("memory_limit") or 0))


def memory_restarts(client: Client, since: float = 0.0) -> list[MemoryRestart]:
    """Workers the Nanny restarted for memory at or after `since` (scheduler clock, seconds)."""
    _note_workers(workers_info(client))
    out = []
    for t, msg in client.get_events(MEMORY_RESTART_TOPIC):
        if t >= since and isinstance(msg, dict):
            addr = str(msg.get("worker", ""))
            name, limit = _SEEN.get(addr, (addr, 0))
            out.append(MemoryRestart(worker=name, rss=int(msg.get("rss", 0)), limit=limit, t=float(t)))
    return out


#: seconds to wait for a TCP connection to `cluster.address` (Dask's own default is 30 s, then
#: two tracebacks); a scheduler on a reachable host accepts in milliseconds
CONNECT_TIMEOUT_S = 5.0


def check_address(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ConfigError, naming `cluster.address`, unless `address` parses as a scheduler
    address and (tcp/tls) a TCP connection to it opens within `timeout` seconds."""
    example = "e.g. tls://10.0.0.5:8786, or remove cluster.address to start a local cluster"
    try:
        scheme, loc = parse_address(address)
        host, port = parse_host_port(loc, default_port=8786) if scheme in ("tcp", "tls") else ("", 0)
    except ValueError as exc:
        raise ConfigError(f"cluster.address {address!r} is not a Dask scheduler address ({exc}); {example}") from None
    if not host:
        return  # inproc:// or ucx://: nothing to dial from here
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise ConfigError(
            f"cluster.address {address!r}: no scheduler reachable at {host}:{port} ({why}, "
            f"{timeout:g} s connect timeout); start the scheduler or fix the address, {example}"
        ) from None


def check_worker_tags(cfg: ExperimentConfig) -> None:
    """For a cluster flexmarl starts (`cluster.workers`): raise ConfigError when a `rollout:<agent>`
    tag names no agent, or an op kind could never be placed (no rollout instance, no `train`
    slot for trainable agents; without load balancing, which moves instances, an agent with
    neither its own instance nor a shared `rollout` worker)."""
    if cfg.cluster.address:
        return  # the remote workers' tags are not in the config
    agents = [a.name for a in cfg.team.agents]
    have: set[str] = set()
    for w in cfg.cluster.workers:
        for tag, amount in w.resources.items():
            name = tag.removeprefix(f"{ROLLOUT_TAG}:")
            if name != tag and name not in agents:
                raise ConfigError(
                    f"cluster.workers[{w.name}].resources: tag {tag!r} names no agent; agents: {agents}"
                )
            if amount > 0:
                have.add(tag)
    hint = "add it to a worker's resources in cluster.workers"
    if not any(is_rollout_tag(t) for t in have):
        raise ConfigError(f"cluster.workers: no worker has a {ROLLOUT_TAG!r} or 'rollout:<agent>' tag, so no rollout can run; {hint}")
    if any(a.trainable for a in cfg.team.agents) and TRAIN_TAG not in have:
        raise ConfigError(f"cluster.workers: no worker has the {TRAIN_TAG!r} tag, so no agent can train; {hint}")
    if not cfg.codesign.load_balancing and ROLLOUT_TAG not in have:
        homeless = [a for a in agents if rollout_tag(a) not in have]
        if homeless:
            raise ConfigError(
                f"cluster.workers: agent(s) {homeless} have no {rollout_tag('<agent>')!r} worker and "
                f"none is tagged {ROLLOUT_TAG!r} (codesign.load_balancing is off, so no instance "
                f"moves to them); {hint}"
            )


#: the variables the math libraries take their thread counts from
BLAS_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class RestartingCluster(SpecCluster):
    """The local cluster: Dask's `SpecCluster`, whose Nannies are never closed because their
    worker was away. `SpecCluster` closes a worker's Nanny for good when, `lost-worker-timeout`
    (15 s) after one removal of that worker, no worker of its name is registered: a worker
    restarted twice within 15 s (killed, then hung: a hung worker is away ~4 s while its Nanny
    waits to kill it) was away at that instant and never came back, and every op pinned to it
    waited out the no-workers timeout. The Nanny restarts its worker itself."""

    def _update_worker_status(self, op: str, msg: Any) -> None:
        Cluster._update_worker_status(self, op, msg)  # SpecCluster's adds only the closing


def start_cluster(
    cfg: ClusterConfig, *, dashboard: bool = True, env: dict[str, str] | None = None
) -> tuple[SpecCluster | None, Client]:
    """A `(cluster, client)` pair: a new local cluster, or (None, client) for `cfg.address`."""
    # The scheduler runs in this process: its default 20 ms tick and 500 ms system monitor
    # cost ~0.08 CPU-s per second idle (measured); coarser ticks cut that by ~60%.
    # Workers sample their task thread's stack every 10 ms for the dashboard's profile tab;
    # on 2 cores that is measurable CPU for a view nobody reads during training (nannies pass
    # this config on to the worker processes).
    dask.config.set({"distributed.scheduler.no-workers-timeout": NO_WORKERS_TIMEOUT,
                     "distributed.worker.profile.enabled": False,
                     "logging.distributed": "warning",
                     "distributed.admin.tick.interval": "100ms",
                     "distributed.admin.system-monitor.interval": "2s",
                     # Dask's nannies export MALLOC_TRIM_THRESHOLD_=65536 to their workers. A
                     # fixed threshold turns off glibc's adaptive mmap threshold, so every
                     # activation tensor over 128 KiB is a fresh mmap + page faults + munmap:
                     # rollouts ran 2.7x and training 1.9x slower than in a plain process
                     # (measured on the default team). None = leave glibc's default.
                     "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                     # A worker's startup banner is logged while it imports distributed, before
                     # the nanny's `env` applies: only the pre-spawn environment quiets it.
                     "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "warning",
                     # Dask sets these to 1 in this process's own environment before a worker
                     # starts, and leaves them: a cluster started ahead does that before the
                     # driver imports torch, whose threads (a warm start's SFT runs here) it would
                     # cut to one. The workers get theirs from the nanny's `env` below instead.
                     **{f"distributed.nanny.pre-spawn-environ.{k}": None
                        for k in BLAS_THREADS}})
    # Scheduler/nanny INFO lines (connections, retirements) drown the run's own output.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if cfg.address:
        check_address(cfg.address)  # fail in seconds, by name, not after Dask's 30 s
        return None, Client(cfg.address, security=cluster_security(cfg))
    _fork_workers_from_one_import(cfg)
    sec = cluster_security(cfg)
    tls = {"security": sec, "protocol": "tls"} if sec is not None else {}
    # A worker forked from the forkserver has the environment the server started with: this
    # process's environment of now goes along, as a spawned worker would have inherited it. Then
    # BLAS/torch threads are pinned so two workers on two cores do not oversubscribe.
    env = {**os.environ, **dict.fromkeys(BLAS_THREADS, str(cfg.torch_threads)),
           "FLEXMARL_TORCH_THREADS": str(cfg.torch_threads),
           "DASK_LOGGING__DISTRIBUTED": "warning",
           # `${env:..}`/`${secret:..}` references resolved now, into the nannies' env only
           **resolve_map(cfg.worker_env, "cluster.worker_env"), **(env or {})}
    workers = {
        w.name: {
            "cls": Nanny,
            "options": {
                "nthreads": w.nthreads,
                "resources": dict(w.resources),
                "memory_limit": w.memory_limit,
                "name": w.name,
                "host": "127.0.0.1",
                **tls,
                "env": {**env, "FLEXMARL_WORKER_NAME": w.name,
                        # the trainer sizes its chunks from it (training/memory.py)
                        MEMORY_ENV: str(dask.utils.parse_bytes(w.memory_limit))},
            },
        }
        for w in cfg.workers
    }
    scheduler = {
        "cls": Scheduler,
        # The scheduler's HTTP server (health, metrics; the dashboard when shown) always runs:
        # on a free loopback port unless the config binds the dashboard elsewhere.
        "options": {"dashboard": bool(dashboard and cfg.dashboard_address),
                    "dashboard_address": (cfg.dashboard_address if dashboard else None) or "127.0.0.1:0",
                    "host": "127.0.0.1", **tls},
    }
    cluster = RestartingCluster(workers=workers, scheduler=scheduler, silence_logs=40, security=sec)
    try:
        client = Client(cluster)
        client.wait_for_workers(len(workers), timeout=120)
        warm_up(client)
    except BaseException:  # a cluster that did not come up whole is stopped, not left running
        cluster.close()
        raise
    return cluster, client


#: What the stages import on first use. transformers loads its modelling code lazily: without
#: this, each worker's first rollout paid ~5 s of imports inside the timed run.
RUNTIME_MODULES = (
    "flexmarl_core.stages", "storage", "torch", "transformers", "flexmarl_core.models",
    "flexmarl_core.inference", "flexmarl_core.training", "flexmarl_core.algorithms",
    "flexmarl_core.workloads", "transformers.models.qwen2.modeling_qwen2",
)


def _fork_workers_from_one_import(cfg: ClusterConfig) -> None:
    """Worker processes fork from one server process that has imported `RUNTIME_MODULES` once
    (Python's forkserver) instead of each starting a fresh interpreter that imports them (seconds
    of torch and transformers per worker, per start and per restart). The server starts with
    this process's first worker and serves every later one. Not where `cluster.worker_env` sets
    anything: libraries read some variables once, as they load (libgomp's `GOMP_SPINCOUNT`,
    glibc's `MALLOC_*`), and in a forked worker they loaded in the server, before the nanny's
    `env` applies; such workers start fresh (spawn), as Dask's default, and so on Windows."""
    fork = not cfg.worker_env and "forkserver" in multiprocessing.get_all_start_methods()
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver" if fork else "spawn"})
    if fork:
        get_mp_context().set_forkserver_preload(["distributed", *RUNTIME_MODULES])


def _import_runtime() -> None:
    for mod in RUNTIME_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError:  # a warm-up, not a requirement: the stage that needs it will say
            pass
    freeze_imports()  # after the imports, so the worker's ops and exit skip them


def warm_up(client: Client) -> None:
    """Import the heavy modules in every worker once, up front, so the first task of each
    worker does not pay seconds of imports (and the bookkeeping measurement starts clean)."""
    client.run(_import_runtime)


def workers_info(client: Client) -> dict[str, dict[str, Any]]:
    """The scheduler's view of every worker, by address, fetched now. Not
    `client.scheduler_info(n_workers=-1)`: that returns the client's cached identity, which its
    own periodic refresh (every 2 s, no per-worker entries) may replace between the fetch and
    the return, and an empty worker list reads as every worker gone."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def worker_resources(client: Client) -> dict[str, dict[str, float]]:
    """Current resource tags of every worker, by address."""
    info = workers_info(client)
    _note_workers(info)
    return {addr: dict(w.get("resources", {})) for addr, w in info.items()}


def _quiet_terminal() -> None:
    """Dask's stream handlers (the terminal) in this process keep only CRITICAL (WARNING and up
    with FLEXMARL_DEBUG set)."""
    terminal = logging.WARNING if os.environ.get("FLEXMARL_DEBUG") else logging.CRITICAL
    for h in logging.getLogger("distributed").handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(terminal)


def _log_to_file(path: Path) -> logging.Handler:
    """Dask's INFO and up go to `path`; its stream handlers (the terminal) keep only CRITICAL
    (WARNING and up with FLEXMARL_DEBUG set): a lost worker is one line of flexmarl's own
    (`driver/console.py`), not Dask's errors."""
    lg = logging.getLogger("distributed")
    for h in list(lg.handlers):
        if getattr(h, "flexmarl_log_file", False):
            lg.removeHandler(h)
            h.close()
    _quiet_terminal()
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(path)
    fh.flexmarl_log_file = True  # type: ignore[attr-defined]
    fh.setLevel(logging.INFO)
    fh.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    lg.addHandler(fh)
    lg.setLevel(logging.INFO)
    return fh


class LogFiles(WorkerPlugin):
    """Each worker logs Dask's INFO lines to `<folder>/dask-<worker>.log` (the terminal gets
    what `_log_to_file` lets through). Named, so registering it again replaces it."""

    name = "flexmarl-log-files"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def setup(self, worker: Any) -> None:
        _log_to_file(Path(self.folder) / f"dask-{worker.name}.log")


def log_to_files(client: Client, folder: str | Path, *, workers: bool) -> Callable[[], None]:
    """Dask's logs of this process (scheduler, client) and, for a cluster whose workers see
    `folder` (the local one), of every worker, into files under `folder`. Returns what stops
    this process's logging there (a later run must not write into this run's folder)."""
    fh = _log_to_file(Path(folder) / "dask-scheduler.log")
    if workers:
        client.register_plugin(LogFiles(str(folder)))

    def stop() -> None:
        logging.getLogger("distributed").removeHandler(fh)
        fh.close()

    return stop


def worker_names(client: Client) -> dict[str, str]:
    """Each worker's name (what its ops report, `w0`), by address (what routing uses)."""
    info = workers_info(client)
    return {addr: str(w.get("name", addr)) for addr, w in info.items()}


def worker_cpu_s(client: Client) -> float:
    """CPU seconds used so far by all worker processes (every thread): with the stages' own CPU
    subtracted, what remains is the bookkeeping of Dask and Prefect."""
    return float(sum(client.run(time.process_time).values()))


#: local clusters started ahead of their run (`start_ahead`), by their config
_AHEAD: dict[str, Future[tuple[SpecCluster | None, Client]]] = {}


def start_ahead(cfg: ClusterConfig) -> None:
    """Start `cfg`'s local cluster in a thread now: its workers' imports (`warm_up`, seconds of
    torch and transformers) then run on the other core while the launch does its own imports
    and checks, instead of after them. `cluster_for` with the same config takes it over;
    `close_ahead` stops one that no run took. Not for a scheduler address, nor where the
    cluster's settings name a `${secret:..}` (resolved from the Prefect API, which the launch
    has not reached yet)."""
    key = cfg.model_dump_json()
    if cfg.address is not None or "${secret:" in key or key in _AHEAD:
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexmarl-cluster-ahead")
    _AHEAD[key] = pool.submit(start_cluster, cfg)
    pool.shutdown(wait=False)


def close_ahead() -> None:
    """Stop the clusters started ahead that no run took over (a launch refused by a later
    check), once they are up: nothing of them is left running."""
    while _AHEAD:
        _, started = _AHEAD.popitem()
        try:
            cluster, client = started.result()
        except Exception:  # it never started, so nothing runs; the launch said why it stopped
            continue
        # The launch's one line is its last: the workers' and nannies' complaints while the
        # cluster stops (a heartbeat cut short) stay off the terminal.
        with contextlib.suppress(Exception):
            client.run(_quiet_terminal)
        _quiet_terminal()
        client.close()
        if cluster is not None:
            cluster.close()


@contextmanager
def cluster_for(cfg: ClusterConfig, env: dict[str, str] | None = None, *,
                dashboard: bool = True) -> Iterator[Client]:
    """Start (and afterwards stop) a local cluster, or connect to `cfg.address`; a cluster
    started ahead for `cfg` (`start_ahead`) is taken over instead of starting another."""
    ahead = _AHEAD.pop(cfg.model_dump_json(), None) if env is None and dashboard else None
    if ahead is None:  # one started for other settings (the layout a later look at the cores gave)
        close_ahead()
    cluster, client = ahead.result() if ahead is not None else start_cluster(cfg, dashboard=dashboard, env=env)
    try:
        yield client
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


async def _set_resources(dask_worker: Any, resources: dict[str, float]) -> None:
    await dask_worker.set_resources(**resources)


def set_worker_resources(client: Client, worker: str, resources: dict[str, float]) -> None:
    """Re-tag one worker. Tasks submitted afterwards route by the new tags; a tag set to 0 is
    taken away (tasks already waiting on it do not move, so route at submit time)."""
    client.run(_set_resources, resources=resources, workers=[worker])
