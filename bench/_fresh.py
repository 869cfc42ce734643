"""What benches that write their own provenance share (`bench/first_run.py`, `bench/suite.py`,
`bench/kuhn.py`): a clone of one commit in a temporary folder, the machine, and its load while
they run (the 1-minute load average, sampled in a thread)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


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
