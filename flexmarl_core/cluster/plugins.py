"""What the core's workers get from the Dask layer, installed as worker plugins (a restarted or
joining worker gets them too): the weight transport (`worker.WeightTransport`), the program
host, and the code `cluster.upload` ships.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import distributed
from distributed import Client, WorkerPlugin

from flexmarl_core.cluster.workers import worker_resources
from flexmarl_core.config import ConfigError
from flexmarl_core.control.tags import ROLLOUT_TAG, rollout_tag
from flexmarl_core.programs.api import MachineryError
from flexmarl_core.programs.engines import install_host
from flexmarl_core.runfiles.transport import holds_engine, install_weight_transport
from flexmarl_core.stages.program import decode_on_instance


# -- weight pushes -------------------------------------------------------------------------------
def push_key(run_uri: str, agent: str, version: int) -> str:
    # str hashes differ between processes: the key must not
    return f"flexmarl-weights-{hashlib.sha1(run_uri.encode()).hexdigest()[:12]}-{agent}-v{version}"


def _holds_engine(run_uri: str, agent: str) -> bool:
    return holds_engine(run_uri, agent)


class DaskWeightPushes(WorkerPlugin):
    """The workers' `transport.WeightTransport` on Dask, installed in each worker as it starts
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
        try:
            home: str | None = distributed.get_worker().address
        except ValueError:  # not in a worker
            home = None
        return DaskDispatcher(ctx.loc.uri, distributed.get_client(), home=home)


class DaskDispatcher:
    """Decodes an agent's batch on its least-loaded instance: the workers tagged
    `rollout:<agent>` (else `rollout`) right now, by the decodes this op has outstanding on
    each; among equally loaded ones, the op's own worker (`home`) first, so concurrent program
    ops with shared instances (`rollout` tags) decode where they run instead of all on the
    first. The task is pinned to that worker by address, not by tag, so an instance move while
    it waits never strands it (the tag goes; the task still runs there)."""

    def __init__(self, run_uri: str, client: Client, tags_ttl_s: float = 0.5, move_grace_s: float = 5.0,
                 home: str | None = None) -> None:
        self.run_uri, self.client, self.tags_ttl_s, self.move_grace_s = run_uri, client, tags_ttl_s, move_grace_s
        self.home = home
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
        # An instance move re-tags a worker; read mid-move, the tags can show the agent none for
        # a moment. Fresh tags for a few seconds before that is an error (seen: the op failed
        # and its retry ran).
        deadline = time.monotonic() + self.move_grace_s
        while not candidates and time.monotonic() < deadline:
            time.sleep(0.2)
            self._tags = (0.0, {})
            candidates = self._instances(agent)
        if not candidates:
            raise MachineryError(f"agent {agent!r}: no worker has resource tag {rollout_tag(agent)!r} or "
                                 f"{ROLLOUT_TAG!r} to decode its calls")
        with self._lock:
            worker = min(candidates, key=lambda w: (self._outstanding.get(w, 0), w != self.home, w))
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
