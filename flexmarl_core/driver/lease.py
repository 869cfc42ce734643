"""A run folder's owner: a lease file that the process running the run holds and renews.

    RUN/run.lease    {"host", "pid", "started", "renewed", "token", "flow_run"}

A second `flexmarl train` on a folder whose lease is alive stops with one line naming the
owner; a fresh run over an existing run needs `--overwrite`; a lease whose owner is gone
(its process is dead on this host, or it has not renewed for `TTL_S`) is taken over by
`--resume` (or `--overwrite`), once: two takers of one stale lease race on an exclusive
marker named by its token, and one wins. The loser of two launches at the same moment gets
the same line as any second launch.

`flexmarl train` takes the lease before it starts the flow run, so a launch that is refused
leaves no flow run behind; the flow adopts the lease its process holds (`RunLease.adopt`) and
names its flow run in it. A flow started otherwise (a deployment) takes the lease itself.

Exclusive creation on local disk is a hard link of a complete temp file (`os.link` fails
if the name exists), so a reader never sees a half-written lease. An object store has no
create-if-absent through `pyarrow.fs`: there the lease is written, then read back after
`SETTLE_S`, and the taker whose token is not the one read back gives way (two launches closer
together than that can both pass; the docs say so).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from flexmarl_core.driver.run import check_run_folder
from flexmarl_core.runfiles.location import (
    CONFIG_NAME,
    LEASE_NAME,
    RUN_MARKER,
    RunLocation,
    make_private,
)

#: a lease not renewed for this long has lost its owner (a process on another host, or one
#: whose liveness this host cannot see)
TTL_S = 90.0
#: how often the owner renews it
RENEW_S = 15.0
#: an object store's read-back delay before a written lease counts as won
SETTLE_S = 2.0


class RunLockedError(RuntimeError):
    """The run folder is in use by a live run; the message names its owner."""


class RunExistsError(RuntimeError):
    """A fresh run was asked for on a folder that holds a run; the message names the choices."""


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    #: the owner process's start time (Linux clock ticks since boot), to tell a reused pid
    pid_start: int | None
    started: float
    renewed: float
    token: str
    #: the Prefect flow run that holds it, if any (marked Crashed when its lease is taken over)
    flow_run: str | None = None

    def owner(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on {self.host}, started {since}"

    def alive(self, now: float | None = None) -> bool:
        """Its owner still runs: on this host, its process lives (same start time); elsewhere,
        it renewed within `TTL_S`."""
        now = time.time() if now is None else now
        if self.host == socket.gethostname():
            return _process_start(self.pid) is not None and _process_start(self.pid) == self.pid_start
        return now - self.renewed < TTL_S


def _process_start(pid: int) -> int | None:
    """A live process's start time (field 22 of /proc/<pid>/stat); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return -1
        return -1  # alive, start unknown (no /proc)


def read_lease(loc: RunLocation) -> Lease | None:
    try:
        data = json.loads(loc.read_text(LEASE_NAME))
        return Lease(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:  # a torn or foreign file: nobody's lease
        raise RunLockedError(f"{loc.display(LEASE_NAME)} is not a lease ({exc}); if no run uses "
                             f"{loc.uri}, delete that file") from None


def holds_run(loc: RunLocation) -> bool:
    """The folder holds (part of) a run: its marker, its config or a lease."""
    return any(loc.exists(k) for k in (RUN_MARKER, CONFIG_NAME, LEASE_NAME))


def _in_use(loc: RunLocation, owner: str) -> str:
    return f"run folder {loc.uri} is in use by another flexmarl train ({owner}); wait for it to end or stop it first"


def check_claim(loc: RunLocation, *, resume: bool, overwrite: bool) -> Lease | None:
    """Whether this launch may take `loc`, without taking it: raises `RunLockedError` while a
    live run holds it, `RunExistsError` for a fresh run over a run without `overwrite`.
    Returns the stale lease a resume would take over (None: no lease)."""
    lease = read_lease(loc)
    if lease is not None and lease.alive():
        raise RunLockedError(_in_use(loc, lease.owner()))
    if not resume and not overwrite and holds_run(loc):
        now = read_lease(loc)  # a launch at the same moment may have taken it since the first look
        if now is not None and now.alive():
            raise RunLockedError(_in_use(loc, now.owner()))
        raise RunExistsError(f"run folder {loc.uri} holds a run: continue it with "
                             f"`flexmarl train --resume {loc.uri}`, or replace it with --overwrite")
    return lease


#: the leases this process holds, by location (`RunLease.adopt`)
_HELD: dict[RunLocation, RunLease] = {}


class RunLease:
    """The lease this process holds on a run folder: `acquire` it, `release` it at the end; a
    daemon thread renews it every `RENEW_S` meanwhile."""

    def __init__(self, loc: RunLocation, lease: Lease, taken_from: Lease | None) -> None:
        self.loc, self.lease = loc, lease
        #: the stale lease this one replaced (its flow run died without ending)
        self.taken_from = taken_from
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="flexmarl-lease", daemon=True)

    @classmethod
    def acquire(cls, loc: RunLocation, *, resume: bool, overwrite: bool,
                flow_run: str | None = None) -> RunLease:
        """Take `loc` for this process (see `check_claim`); a fresh run also checks that the
        folder is empty or a run folder (`run.check_run_folder`) before it leaves a lease."""
        if not resume:
            check_run_folder(loc)
        stale = check_claim(loc, resume=resume, overwrite=overwrite)
        now = time.time()
        mine = Lease(socket.gethostname(), os.getpid(), _process_start(os.getpid()), now, now,
                     uuid.uuid4().hex, flow_run)
        if stale is None:
            _create(loc, LEASE_NAME, mine)
        else:  # one taker per stale lease: an exclusive marker named by its token
            _create(loc, f"{LEASE_NAME}.taken-{stale.token}", mine)
            loc.write_text(LEASE_NAME, json.dumps(asdict(mine)))
            loc.delete(f"{LEASE_NAME}.taken-{stale.token}")
        held = cls(loc, mine, stale)
        held._thread.start()
        _HELD[loc] = held
        return held

    @classmethod
    def adopt(cls, loc: RunLocation, flow_run: str | None) -> RunLease | None:
        """The lease this process already holds on `loc` (the CLI took it before starting the
        flow run), now naming `flow_run`; None when it holds none."""
        held = _HELD.get(loc)
        if held is None:
            return None
        if flow_run is not None and held.lease.flow_run != flow_run:
            held.lease = Lease(**{**asdict(held.lease), "flow_run": flow_run})
            held.loc.write_text(LEASE_NAME, json.dumps(asdict(held.lease)))
        return held

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                current = read_lease(self.loc)
                if current is None or current.token != self.lease.token:
                    return  # taken over (we were deemed dead): never write over the new owner
                self.lease = Lease(**{**asdict(self.lease), "renewed": time.time()})
                self.loc.write_text(LEASE_NAME, json.dumps(asdict(self.lease)))
            except (OSError, RunLockedError):
                continue  # a storage hiccup: the next renewal tries again

    def release(self) -> None:
        self._stop.set()
        if _HELD.get(self.loc) is self:
            del _HELD[self.loc]
        try:
            current = read_lease(self.loc)
        except RunLockedError:
            return
        if current is not None and current.token == self.lease.token:
            self.loc.delete(LEASE_NAME)

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _create(loc: RunLocation, key: str, lease: Lease) -> None:
    """Create `key` holding `lease` only if it does not exist; `RunLockedError` if another
    launch created it first."""
    data = json.dumps(asdict(lease)).encode()
    if loc.local:
        make_private(loc.root)  # a new run folder is its owner's only (0700)
        # Beside the folder, not in it: a launch checking the folder meanwhile must not find
        # a stray file there (`check_run_folder`); inside it where the parent is not writable.
        parent, name = os.path.split(loc.root.rstrip("/"))
        try:
            tmp = _write_whole(os.path.join(parent, f".{name}.{key}.{lease.token}"), data)
        except PermissionError:
            tmp = _write_whole(loc.path(f".{key}.{lease.token}"), data)
        try:
            os.link(tmp, loc.path(key))  # whole, or not at all: fails if another launch made it
        except FileExistsError:
            raise RunLockedError(_lost_race(loc, key)) from None
        finally:
            os.unlink(tmp)
        return
    if loc.exists(key):
        raise RunLockedError(_lost_race(loc, key))
    loc.write_bytes(key, data)
    time.sleep(SETTLE_S)
    if json.loads(loc.read_text(key)).get("token") != lease.token:
        raise RunLockedError(_lost_race(loc, key))


def _write_whole(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return path


def _lost_race(loc: RunLocation, key: str) -> str:
    """The line of any launch on a folder in use: the loser of a race is refused like a
    second launch."""
    try:
        owner = Lease(**json.loads(loc.read_text(key))).owner()
    except (OSError, ValueError, TypeError):
        owner = "another launch"
    return _in_use(loc, owner)
