"""How weights reach a worker process besides their files: the seam a cluster adapter fills.

Every process can read a published weights file (`weights.py`). A cluster may also carry a
sync's new weights to the other processes that hold an engine of the agent (on Dask a peer to
peer broadcast, `cluster.plugins.DaskWeightPushes`), so N instances do not read one object N
times. The adapter installs its transport in each worker as the worker starts; the default,
`FilesOnly`, pushes nothing. Standard library only: a worker imports this while it starts.
"""

from __future__ import annotations

import threading
from typing import Protocol


class WeightTransport(Protocol):
    """Carries a sync's new weights to the other processes that hold an engine of the agent."""

    def push(self, run_uri: str, agent: str, version: int, blob: bytes) -> dict[str, float]:
        """From the process that ran the sync: send `blob` (safetensors bytes of `version`) to
        the others that hold an engine of `agent` (`holds_engine`); what it measured."""
        ...

    def pushed(self, run_uri: str, agent: str, version: int) -> bytes | None:
        """The bytes of `version` a sync pushed to this process, if it holds them."""
        ...


class FilesOnly:
    """The default transport: nothing is pushed; every process reads the published file."""

    def push(self, run_uri: str, agent: str, version: int, blob: bytes) -> dict[str, float]:
        return {}

    def pushed(self, run_uri: str, agent: str, version: int) -> bytes | None:
        return None


_TRANSPORT: list[WeightTransport] = [FilesOnly()]
_LOCK = threading.Lock()
#: (run URI, agent) of every engine this process holds
_ENGINES: set[tuple[str, str]] = set()


def install_weight_transport(transport: WeightTransport | None) -> None:
    """Use `transport` in this process from now on (None: back to `FilesOnly`)."""
    _TRANSPORT[0] = transport if transport is not None else FilesOnly()


def weight_transport() -> WeightTransport:
    """This process's transport (`install_weight_transport`)."""
    return _TRANSPORT[0]


def serving(run_uri: str, agent: str) -> None:
    """This process now holds an engine of `agent` for the run at `run_uri`."""
    with _LOCK:
        _ENGINES.add((run_uri, agent))


def holds_engine(run_uri: str, agent: str) -> bool:
    """Whether this process holds an engine of `agent` for the run at `run_uri` (a sync pushes
    new weights only to such processes)."""
    with _LOCK:
        return (run_uri, agent) in _ENGINES
