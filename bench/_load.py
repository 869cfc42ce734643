"""The machine's load while a bench runs: the 1-minute load average, sampled in a thread."""

from __future__ import annotations

import statistics
import threading
from pathlib import Path


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
