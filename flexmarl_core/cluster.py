"""Adapts the core to a Dask cluster: the only module of `flexmarl_core` that imports Dask.

- `start_cluster` starts a local cluster whose worker processes carry their own resource tags
  (`DaskTaskRunner(cluster_kwargs=...)` would give every worker the same ones), or connects to a
  scheduler address.
- `worker_resources` / `set_worker_resources` read and re-tag workers at run time; that is how
  the load balancer moves an inference instance from one agent to another.
- `DaskExecutor` runs the orchestrator's ops as plain Dask tasks; the Prefect executor in
  `tasks/` is this one plus the task runs it reports to Prefect.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dask
import distributed
from distributed import Client, Nanny, Scheduler, SpecCluster, WorkerPlugin
from distributed.comm.addressing import parse_address, parse_host_port

from flexmarl_core.config import ClusterConfig, ConfigError, ExperimentConfig
from flexmarl_core.control.tags import ROLLOUT_TAG, TRAIN_TAG, rollout_tag
from flexmarl_core.ops import MEMORY_ENV, FusedResult, MemoryRestart, Op, Route, StageResult
from flexmarl_core.programs.api import MachineryError
from flexmarl_core.programs.engines import install_host
from flexmarl_core.stages import run_fused, run_stage_after, run_stage_retrying
from flexmarl_core.stages.program import decode_on_instance
from flexmarl_core.worker import holds_engine, install_weight_transport

# A task whose tag no worker has would otherwise wait forever, with no error and no Prefect
# task run (Dask's default; seen with distributed 2026.8). The orchestrator
# checks tags before it submits; this is the backstop, and how a task pinned to a worker that
# died comes back to the orchestrator to be routed again.
NO_WORKERS_TIMEOUT = "15s"

#: Errors that mean a task's worker died or vanished, not that the task failed.
LOST_WORKER_ERRORS: tuple[type[BaseException], ...] = (
    distributed.scheduler.KilledWorker,
    distributed.scheduler.NoValidWorkerError,
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
    _note_workers(client.scheduler_info(n_workers=-1)["workers"])
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
    example = "e.g. tcp://10.0.0.5:8786, or remove cluster.address to start a local cluster"
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
    if not any(t == ROLLOUT_TAG or t.startswith(f"{ROLLOUT_TAG}:") for t in have):
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
                     "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "warning"})
    # Scheduler/nanny INFO lines (connections, retirements) drown the run's own output.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if cfg.address:
        check_address(cfg.address)  # fail in seconds, by name, not after Dask's 30 s
        return None, Client(cfg.address)
    # Worker processes inherit the environment; pin BLAS/torch threads before they start so two
    # workers on two cores do not oversubscribe.
    env = {"OMP_NUM_THREADS": str(cfg.torch_threads), "MKL_NUM_THREADS": str(cfg.torch_threads),
           "FLEXMARL_TORCH_THREADS": str(cfg.torch_threads),
           "DASK_LOGGING__DISTRIBUTED": "warning", **cfg.worker_env, **(env or {})}
    workers = {
        w.name: {
            "cls": Nanny,
            "options": {
                "nthreads": w.nthreads,
                "resources": dict(w.resources),
                "memory_limit": w.memory_limit,
                "name": w.name,
                "env": {**env, "FLEXMARL_WORKER_NAME": w.name,
                        # the trainer sizes its chunks from it (training/memory.py)
                        MEMORY_ENV: str(dask.utils.parse_bytes(w.memory_limit))},
            },
        }
        for w in cfg.workers
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"dashboard_address": ":0" if dashboard else None, "host": "127.0.0.1"},
    }
    cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40)
    client = Client(cluster)
    client.wait_for_workers(len(workers), timeout=120)
    warm_up(client)
    return cluster, client


#: What the stages import on first use. transformers loads its modelling code lazily: without
#: this, each worker's first rollout paid ~5 s of imports inside the timed run.
RUNTIME_MODULES = (
    "flexmarl_core.stages", "storage", "torch", "transformers", "flexmarl_core.models",
    "flexmarl_core.inference", "flexmarl_core.training", "flexmarl_core.algorithms",
    "flexmarl_core.workloads", "transformers.models.qwen2.modeling_qwen2",
)


def _import_runtime() -> None:
    for mod in RUNTIME_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError:  # a warm-up, not a requirement: the stage that needs it will say
            pass


def warm_up(client: Client) -> None:
    """Import the heavy modules in every worker once, up front, so the first task of each
    worker does not pay seconds of imports (and the bookkeeping measurement starts clean)."""
    client.run(_import_runtime)


def worker_resources(client: Client) -> dict[str, dict[str, float]]:
    """Current resource tags of every worker, by address."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    _note_workers(info)
    return {addr: dict(w.get("resources", {})) for addr, w in info.items()}


def _log_to_file(path: Path) -> None:
    """Dask's INFO and up go to `path`; its stream handlers (the terminal) keep WARNING and up."""
    lg = logging.getLogger("distributed")
    for h in list(lg.handlers):
        if getattr(h, "flexmarl_log_file", False):
            lg.removeHandler(h)
            h.close()
        elif isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(logging.WARNING)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(path)
    fh.flexmarl_log_file = True  # type: ignore[attr-defined]
    fh.setLevel(logging.INFO)
    fh.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    lg.addHandler(fh)
    lg.setLevel(logging.INFO)


class LogFiles(WorkerPlugin):
    """Each worker logs Dask's INFO lines to `<folder>/dask-<worker>.log` (WARNING and up
    still reach the terminal). Named, so registering it again replaces it."""

    name = "flexmarl-log-files"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def setup(self, worker: Any) -> None:
        _log_to_file(Path(self.folder) / f"dask-{worker.name}.log")


def log_to_files(client: Client, folder: str | Path, *, workers: bool) -> None:
    """Dask's logs of this process (scheduler, client) and, for a cluster whose workers see
    `folder` (the local one), of every worker, into files under `folder`."""
    _log_to_file(Path(folder) / "dask-scheduler.log")
    if workers:
        client.register_plugin(LogFiles(str(folder)))


def worker_names(client: Client) -> dict[str, str]:
    """Each worker's name (what its ops report, `w0`), by address (what routing uses)."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {addr: str(w.get("name", addr)) for addr, w in info.items()}


def worker_cpu_s(client: Client) -> float:
    """CPU seconds used so far by all worker processes (every thread): with the stages' own CPU
    subtracted, what remains is the bookkeeping of Dask and Prefect."""
    return float(sum(client.run(time.process_time).values()))


@contextmanager
def cluster_for(cfg: ClusterConfig, env: dict[str, str] | None = None) -> Iterator[Client]:
    """Start (and afterwards stop) a local cluster, or connect to `cfg.address`."""
    cluster, client = start_cluster(cfg, env=env)
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


class DaskExecutor:
    """Runs ops as plain Dask tasks: `stages.run_stage_retrying(run_dir, op, ...)` on the worker
    the route names, each op tried up to `1 + retries[op.kind]` times there; it chains, fuses
    and reports memory restarts (`executor_api`). The real run's executor
    (`tasks/executor.py`) adds the Prefect task runs on top."""

    def __init__(self, client: Client, run_dir: str, *, retries: dict[str, int] | None = None,
                 retry_delay_s: float = 1.0) -> None:
        self.client = client
        self.run_dir = str(run_dir)
        self.retries = dict(retries or {})
        self.retry_delay_s = retry_delay_s
        self._tags: tuple[float, dict[str, dict[str, float]]] | None = None
        client.register_plugin(DaskWeightPushes())  # before any op: syncs push, rollouts take
        client.register_plugin(DaskPrograms())  # program ops secede and decode on instances

    def submit(self, op: Op, route: Route, deps: Sequence[Op] = (),
               after: Sequence[distributed.Future] = ()) -> distributed.Future:
        """`after`: futures of the ops `op` is chained on. Dask runs it once they are done (their
        results, small `StageResult`s, are its ignored arguments); if one fails, so does it."""
        return self.client.submit(
            run_stage_after if after else run_stage_retrying,
            self.run_dir, op, self.retries.get(op.kind, 0), self.retry_delay_s, *after,
            gradient_only=route.gradient_only,
            key=f"{op.name}-{os.urandom(4).hex()}",
            resources=route.resources or None,
            workers=[route.worker] if route.worker else None,
            pure=False,
        )

    def submit_fused(self, ops: Sequence[Op], route: Route, deps: Sequence[Sequence[Op]] = (),
                     after: Sequence[distributed.Future] = ()) -> distributed.Future:
        """One Dask task running `ops` in order where `route` says (`stages.run_fused`); its
        result is a `FusedResult`. `deps`: each op's dependencies (see `submit`)."""
        return self.client.submit(
            run_fused, self.run_dir, list(ops), [self.retries.get(op.kind, 0) for op in ops],
            self.retry_delay_s, *after,
            key=f"{ops[0].name}+{len(ops) - 1}-{os.urandom(4).hex()}",
            resources=route.resources or None,
            workers=[route.worker] if route.worker else None,
            pure=False,
        )

    def cancel(self, handle: distributed.Future) -> None:
        handle.cancel()

    def succeeded(self, handle: distributed.Future) -> bool:
        return handle.status == "finished"

    def wait_any(self, handles: Sequence[distributed.Future], timeout: float | None = None) -> list[Any]:
        try:
            done, _ = distributed.wait(list(handles), timeout=timeout, return_when="FIRST_COMPLETED")
        except TimeoutError:  # Dask raises where concurrent.futures returns nothing done
            return []
        return list(done)

    def result(self, handle: distributed.Future) -> StageResult | FusedResult:
        return handle.result()

    def now(self) -> float:
        return time.time()

    def worker_resources(self) -> dict[str, dict[str, float]]:
        # Tags change only when we re-tag (which invalidates) or a worker joins/leaves: a
        # short-lived cache saves a scheduler round trip per submission wave.
        now = time.monotonic()
        if self._tags is None or now - self._tags[0] > 1.0:
            tags = worker_resources(self.client)
            if not tags:  # a transient empty view (worker restarting) must not be cached
                return tags
            self._tags = (now, tags)
        return self._tags[1]

    def set_worker_resources(self, worker: str, resources: dict[str, float]) -> None:
        set_worker_resources(self.client, worker, resources)
        self._tags = None

    def lost(self, exc: BaseException) -> bool:
        if lost_worker(exc):
            self._tags = None  # the worker set changed: route the resubmission on fresh tags
            return True
        return False

    def memory_restarts(self, since: float) -> list[MemoryRestart]:
        return memory_restarts(self.client, since)


# -- weight pushes -------------------------------------------------------------------------------
def push_key(run_uri: str, agent: str, version: int) -> str:
    # str hashes differ between processes: the key must not
    return f"flexmarl-weights-{hashlib.sha1(run_uri.encode()).hexdigest()[:12]}-{agent}-v{version}"


def _holds_engine(run_uri: str, agent: str) -> bool:
    return holds_engine(run_uri, agent)


class DaskWeightPushes(WorkerPlugin):
    """The workers' `worker.WeightTransport` on Dask, installed in each worker as it starts
    (a named plugin: registering it again replaces it; a restarted worker gets it too).

    A sync broadcasts the published weights to the other workers that hold an engine of the
    agent, peer to peer (`scatter(broadcast=True)` puts them in this worker's memory and Dask
    replicates them along a tree), so N instances need not each read the same object from
    storage. Each receiver takes them from its memory when its next rollout asks for that
    version (`pushed`); a worker that misses them reads the file as before."""

    name = "flexmarl-weight-pushes"

    def __init__(self) -> None:
        self.worker: distributed.Worker | None = None
        #: per (run, agent), the future of the last weights this worker broadcast: holding it
        #: keeps the copies alive on the receivers until the next version replaces it
        self._pushed: dict[tuple[str, str], distributed.Future] = {}

    def setup(self, worker: distributed.Worker) -> None:
        self.worker = worker
        install_weight_transport(self)

    def teardown(self, worker: distributed.Worker) -> None:
        install_weight_transport(None)
        self._pushed.clear()

    def push(self, run_uri: str, agent: str, version: int, blob: bytes) -> dict[str, float]:
        """From inside the sync's task: broadcast `blob` to the engines' other workers; what it
        measured."""
        if self.worker is None:
            return {}
        client = distributed.get_client()
        t0 = time.perf_counter()
        holders = [a for a, yes in client.run(_holds_engine, run_uri, agent).items()
                   if yes and a != self.worker.address]
        if not holders:
            return {"push_targets": 0.0}
        key = push_key(run_uri, agent, version)
        fut = client.scatter({key: blob}, workers=holders, broadcast=True, hash=False)[key]
        self._pushed[(run_uri, agent)] = fut  # the previous version's copies are released
        return {"push_targets": float(len(holders)), "push_s": time.perf_counter() - t0}

    def pushed(self, run_uri: str, agent: str, version: int) -> bytes | None:
        if self.worker is None:
            return None
        blob = self.worker.data.get(push_key(run_uri, agent, version))
        return blob if isinstance(blob, bytes) else None


# -- code for the workers ------------------------------------------------------------------------
#: folders never shipped with `cluster.upload` (environments, caches, run outputs, tests)
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".cache", ".prefect", "runs", "tests", "node_modules"}


def zip_code(folder: Path, out: Path) -> Path:
    """The .py files under `folder` in a zip, named relative to `folder`: its packages and
    modules are importable from the zip's root (`examples/custom_team/reward.py` ->
    `examples.custom_team.reward`)."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if not SKIP_DIRS.intersection(rel.parts[:-1]):
                z.write(path, rel.as_posix())
    return out


def upload_code(client: Client, paths: Sequence[str]) -> list[str]:
    """Ship `cluster.upload` to every worker through Dask (`Client.upload_file`, registered as a
    plugin, so a worker that joins or restarts later gets it too): a folder goes as a zip of its
    .py files, put first on the worker's `sys.path`; a .py or .zip file as it is. Returns what
    was sent, by name. Call before any task: a worker unpickles a task by importing its code."""
    sent = []
    with tempfile.TemporaryDirectory(prefix="flexmarl-upload-") as tmp:
        for entry in paths:
            src = Path(entry).expanduser().resolve()
            if src.is_dir():
                tag = hashlib.sha1(str(src).encode()).hexdigest()[:8]
                src = zip_code(src, Path(tmp) / f"flexmarl-code-{src.name or 'root'}-{tag}.zip")
            elif not (src.is_file() and src.suffix in (".py", ".zip", ".egg")):
                raise ConfigError(f"cluster.upload: {entry!r} is neither a folder nor a .py/.zip/.egg file")
            client.upload_file(str(src))  # load: a zip goes on sys.path, its packages imported
            sent.append(src.name)
    return sent


# -- program teams -------------------------------------------------------------------------------
class DaskPrograms(WorkerPlugin):
    """Installs `DaskProgramHost` in each worker as it starts (named: registering it again
    replaces it; a restarted worker gets it too)."""

    name = "flexmarl-programs"

    def setup(self, worker: distributed.Worker) -> None:
        install_host(DaskProgramHost())


class DaskProgramHost:
    """Program ops on Dask: the op secedes from the worker's thread pool while its trajectories
    wait on their calls (the worker runs other ops meanwhile), and each batch of an agent's
    calls is a Dask task on one of the agent's instances (`DaskDispatcher`)."""

    @contextmanager
    def detached(self) -> Iterator[None]:
        try:
            distributed.secede()
        except ValueError:  # not inside a task: nothing to leave
            yield
            return
        try:
            yield
        finally:
            distributed.rejoin()

    def dispatcher(self, ctx: Any, worker: str) -> DaskDispatcher:
        return DaskDispatcher(ctx.loc.uri, distributed.get_client())


class DaskDispatcher:
    """Decodes an agent's batch on its least-loaded instance: the workers tagged
    `rollout:<agent>` (else `rollout`) right now, by the decodes this op has outstanding on
    each. The task is pinned to that worker by address, not by tag, so an instance move while
    it waits never strands it (the tag goes; the task still runs there)."""

    def __init__(self, run_uri: str, client: Client, tags_ttl_s: float = 0.5) -> None:
        self.run_uri, self.client, self.tags_ttl_s = run_uri, client, tags_ttl_s
        self._outstanding: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tags: tuple[float, dict[str, dict[str, float]]] = (0.0, {})

    def _instances(self, agent: str) -> list[str]:
        t, tags = self._tags
        if time.monotonic() - t > self.tags_ttl_s:
            tags = worker_resources(self.client)
            self._tags = (time.monotonic(), tags)
        own = sorted(w for w, r in tags.items() if r.get(rollout_tag(agent), 0) > 0)
        return own or sorted(w for w, r in tags.items() if r.get(ROLLOUT_TAG, 0) > 0)

    def capacity(self, agent: str) -> int:
        return max(len(self._instances(agent)), 1)

    def decode(self, agent: str, version: int, groups: Sequence[Any], stats: Any) -> list[list[Any]]:
        candidates = self._instances(agent)
        if not candidates:
            raise MachineryError(f"agent {agent!r}: no worker has resource tag {rollout_tag(agent)!r} or "
                                 f"{ROLLOUT_TAG!r} to decode its calls")
        with self._lock:
            worker = min(candidates, key=lambda w: (self._outstanding.get(w, 0), w))
            self._outstanding[worker] = self._outstanding.get(worker, 0) + 1
        try:
            fut = self.client.submit(decode_on_instance, self.run_uri, agent, version, list(groups),
                                     workers=[worker], allow_other_workers=False, pure=False,
                                     key=f"decode-{agent}-v{version}-{uuid.uuid4().hex[:12]}")
            gens, got = fut.result()
        except MachineryError:
            raise
        except Exception as exc:  # the instance died or the task failed: the op fails and is retried
            raise MachineryError(f"agent {agent!r}: decode on {worker} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                self._outstanding[worker] -= 1
        stats.seconds, stats.instance, stats.t_start, stats.t_end = got.seconds, got.instance, got.t_start, got.t_end
        return gens
