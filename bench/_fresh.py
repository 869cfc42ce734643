"""What benches that write their own provenance share (`bench/first_run.py`, `bench/suite.py`,
`bench/kuhn.py`, `bench/roles.py`, `bench/policy_failures.py`, ...): a clone of one commit in a
temporary folder, the machine, and its load while they run (the 1-minute load average, sampled in
a thread); for the learning benches, a record's provenance, a local two-worker Dask cluster and
one run trained on it."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fresh_clone(repo: Path, commit: str, prefix: str) -> tuple[str, Path, Path]:
    """`(sha, work folder, clone)`: `repo` cloned at `commit` into a new temporary folder."""
    sha = subprocess.check_output(["git", "-C", str(repo), "rev-parse", commit], text=True).strip()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    clone = work / "flexmarl"
    subprocess.run(["git", "clone", "--quiet", str(repo), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", sha], check=True)
    return sha, work, clone


def machine() -> dict[str, object]:
    """What a record says of the machine it was made on."""
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem, 1), "python": sys.version.split()[0]}


def load_now() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class LoadSampler(threading.Thread):
    """The 1-minute load average every `every` seconds until stopped."""

    def __init__(self, every: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.every, self.samples, self._halt = every, [], threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self.samples.append(load_now())

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join()
        s = self.samples or [load_now()]
        return {"mean": round(statistics.fmean(s), 2), "max": round(max(s), 2), "samples": len(s)}


def spread(xs: list[float]) -> float:
    """The standard deviation of a figure over seeds (0 for one seed)."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


@contextmanager
def provenance(repo: Path) -> Iterator[dict[str, Any]]:
    """A bench record's provenance: the commit (taken before the work runs), date, start, machine
    and load before; once the block ends, its wall time, the load during it and the command."""
    load = LoadSampler()
    load.start()
    rec: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                                 text=True).stdout.strip(),
        "start_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
        "load_before": Path("/proc/loadavg").read_text().split()[:3]}
    t0 = time.time()
    try:
        yield rec
    finally:
        rec.update(wall_s=time.time() - t0, load=load.stop(),
                   command=" ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


@contextmanager
def local_cluster() -> Iterator[Any]:
    """A Dask client on a local cluster of two workers tagged for rollout and training, closed after."""
    from flexmarl_core.cluster import cluster_for
    from flexmarl_core.config import ClusterConfig

    with cluster_for(ClusterConfig.model_validate({"workers": [
            {"name": "w0", "resources": {"rollout": 1, "train": 1}},
            {"name": "w1", "resources": {"rollout": 1, "train": 1}}]}), dashboard=False) as client:
        yield client


def train_run(config: str, overrides: list[str], client: Any) -> tuple[Any, Path, Any, float]:
    """`(cfg, run folder, run.train's result, RL seconds)`: `config` with `overrides` trained on
    `client`'s cluster through the real stages and store (no Prefect)."""
    from flexmarl_core import cluster
    from flexmarl_core.config import load_config
    from flexmarl_core.driver import run

    cfg = load_config(config, overrides)
    folder = run.prepare_run(cfg, log=lambda _: None)
    t0 = time.time()
    res = run.train(cfg, folder, cluster.DaskExecutor(client, str(folder)))
    return cfg, folder, res, time.time() - t0


def drain_prefect() -> None:
    """Send the flow runs' last logs and events on their way, before a bench stops the Prefect
    server it started (at exit they would meet a dead server and print errors)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
