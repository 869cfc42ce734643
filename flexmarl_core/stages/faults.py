"""Fault injection for tests and chaos drills: marker files name the op they hit."""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import lru_cache

from flexmarl_core.runfiles.location import FAULTS_SUFFIX, RunLocation, is_uri
from storage.atomic import atomic_file


class InjectedFault(RuntimeError):
    """A failure injected by a `raise@`/`fail@` marker (see `faults_dir`), never a real one."""


def faults_dir(run_dir: str | os.PathLike[str]) -> str:
    """A marker file in this folder (next to the run folder, so starting the run does not wipe
    it) names the op (`<kind>@<Op.name>`) it hits as that op starts:

    - `kill@<op>`: the worker process SIGKILLs itself once (a real process death; Dask, not
      Prefect, reruns the op).
    - `raise@<op>`: the stage raises `InjectedFault` once (Prefect's task retries rerun it).
    - `fail@<op>`: the stage raises `InjectedFault` N times, N the file's integer content
      (empty: 1), one per attempt; N above the task's retries fails the op, hence the flow run.
    - `hog@<op>`: the stage allocates memory until the worker is restarted for it, on every
      attempt (an op that can never fit, like an oversized micro-batch); not consumed.
    - `hang@<op>`: the op neither returns nor fails, once: what `cluster.deadlines` is for
      (the orchestrator cancels it, restarts its worker and runs it again). A number in the
      file caps the hang at that many seconds, then the op raises `InjectedFault` (a test
      whose run missed the hang fails, late, instead of never ending); empty: for good.
    - `slow@<op>`: the op first sleeps for the file's number of seconds (empty: 1), once (a
      straggler: what the scheduler does while one op holds its worker).
    - `hold@<op>`: the op waits, holding its worker, until `release@<op>` appears (`release`),
      once; while it waits, `held@<op>` exists (`held_ops`). A test that needs one op to run
      while another is still busy holds the busy one until it has seen what it needs, instead
      of betting that a sleep outlasts the other work. Not released within the file's number
      of seconds (empty: `HOLD_LIMIT_S`), the op raises `InjectedFault`.

    Other markers are consumed (removed, or decremented) before they fire, so the rerun goes
    through. For a run on an object store the folder is the prefix `<run uri>.faults/`."""
    return os.fspath(run_dir).rstrip("/") + FAULTS_SUFFIX


#: how long a `hold@` op waits for its release by default (a test that forgot it fails, late)
HOLD_LIMIT_S = 600.0
#: how often a held op looks for its release
HOLD_POLL_S = 0.05


def held_ops(run_dir: str | os.PathLike[str]) -> set[str]:
    """The ops that wait on a `hold@` marker now (local run folders)."""
    folder = faults_dir(run_dir)
    if not os.path.isdir(folder):
        return set()
    return {name[len("held@"):] for name in os.listdir(folder) if name.startswith("held@")}


def release(run_dir: str | os.PathLike[str], op_name: str) -> None:
    """Let the op held by `hold@<op_name>` go on (now, or at once when it starts later)."""
    folder = faults_dir(run_dir)
    os.makedirs(folder, exist_ok=True)
    _create(os.path.join(folder, f"release@{op_name}"), "")


@lru_cache(maxsize=8)
def _remote(folder: str) -> RunLocation:
    return RunLocation(folder)  # one filesystem client per process, not one per op


def fault_point(run_dir: str, op_name: str) -> None:
    folder = faults_dir(run_dir)
    if is_uri(folder):
        _remote_fault_point(_remote(folder), op_name)
        return
    if not os.path.isdir(folder):  # the common case: one stat, no fault injection
        return
    kill = os.path.join(folder, f"kill@{op_name}")
    if os.path.exists(kill):
        os.remove(kill)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.path.exists(os.path.join(folder, f"hog@{op_name}")):
        _hog()
    hang = os.path.join(folder, f"hang@{op_name}")
    if os.path.exists(hang):
        with open(hang) as f:
            text = f.read()
        os.remove(hang)
        _hang(text, op_name)
    hold = os.path.join(folder, f"hold@{op_name}")
    if os.path.exists(hold):
        _hold(folder, op_name)
    slow = os.path.join(folder, f"slow@{op_name}")
    if os.path.exists(slow):
        with open(slow) as f:
            text = f.read().strip()
        os.remove(slow)
        time.sleep(float(text) if text else 1.0)
    once = os.path.join(folder, f"raise@{op_name}")
    if os.path.exists(once):
        os.remove(once)
        raise InjectedFault(f"injected fault (raise@) in {op_name}")
    counted = os.path.join(folder, f"fail@{op_name}")
    if os.path.exists(counted):
        with open(counted) as f:
            text = f.read().strip()
        left = int(text) if text else 1
        if left <= 1:
            os.remove(counted)
        else:  # replace, not rewrite in place: a reader never sees a torn count
            _create(counted, str(left - 1))
        if left >= 1:
            raise InjectedFault(f"injected fault (fail@, {left} left) in {op_name}")


def _create(path: str, text: str) -> None:
    """Write `path` whole (temp file + rename): a reader never sees it half-written."""
    with atomic_file(path) as f:
        f.write(text.encode())


def _limit(text: str, op_name: str) -> float:
    try:
        return float(text) if text.strip() else HOLD_LIMIT_S
    except ValueError:
        raise ValueError(f"hold@{op_name}: the marker holds {text!r}; write a number of seconds "
                         "(the longest the op waits for its release) or nothing") from None


def _hold(folder: str, op_name: str) -> None:
    """`hold@<op>`: wait for `release@<op>`, saying so with `held@<op>`; then remove all three."""
    marker = os.path.join(folder, f"hold@{op_name}")
    held = os.path.join(folder, f"held@{op_name}")
    released = os.path.join(folder, f"release@{op_name}")
    with open(marker) as f:
        limit = _limit(f.read(), op_name)
    _create(held, str(os.getpid()))
    deadline = time.monotonic() + limit
    try:
        while not os.path.exists(released):
            if time.monotonic() > deadline:
                raise InjectedFault(f"injected fault (hold@) in {op_name}: not released within {limit:g} s")
            time.sleep(HOLD_POLL_S)
    finally:  # consumed either way: a rerun goes through
        for path in (marker, released, held):
            if os.path.exists(path):
                os.remove(path)


def _remote_fault_point(loc: RunLocation, op_name: str) -> None:
    """`fault_point` on an object store: one listing per op, the same markers."""
    names = set(loc.list())
    if not names:
        return
    if f"kill@{op_name}" in names:
        loc.delete(f"kill@{op_name}")
        os.kill(os.getpid(), signal.SIGKILL)
    if f"hog@{op_name}" in names:
        _hog()
    if f"hang@{op_name}" in names:
        text = loc.read_text(f"hang@{op_name}")
        loc.delete(f"hang@{op_name}")
        _hang(text, op_name)
    if f"hold@{op_name}" in names:
        _remote_hold(loc, op_name)
    if f"slow@{op_name}" in names:
        text = loc.read_text(f"slow@{op_name}").strip()
        loc.delete(f"slow@{op_name}")
        time.sleep(float(text) if text else 1.0)
    if f"raise@{op_name}" in names:
        loc.delete(f"raise@{op_name}")
        raise InjectedFault(f"injected fault (raise@) in {op_name}")
    counted = f"fail@{op_name}"
    if counted in names:
        text = loc.read_text(counted).strip()
        left = int(text) if text else 1
        if left <= 1:
            loc.delete(counted)
        else:  # one PUT replaces the object whole
            loc.write_text(counted, str(left - 1))
        if left >= 1:
            raise InjectedFault(f"injected fault (fail@, {left} left) in {op_name}")


def _remote_hold(loc: RunLocation, op_name: str) -> None:
    """`_hold` on an object store: one listing per poll."""
    limit = _limit(loc.read_text(f"hold@{op_name}"), op_name)
    loc.write_text(f"held@{op_name}", str(os.getpid()))
    deadline = time.monotonic() + limit
    try:
        while f"release@{op_name}" not in set(loc.list()):
            if time.monotonic() > deadline:
                raise InjectedFault(f"injected fault (hold@) in {op_name}: not released within {limit:g} s")
            time.sleep(4 * HOLD_POLL_S)
    finally:
        for name in (f"hold@{op_name}", f"release@{op_name}", f"held@{op_name}"):
            loc.delete(name)


def _hang(text: str, op_name: str) -> None:
    """Block this thread quietly (only the worker's restart ends it), for good or `text` s."""
    try:
        cap = float(text) if text.strip() else None
    except ValueError:
        raise ValueError(f"hang@{op_name}: the marker holds {text!r}; write a number of seconds "
                         "(the longest the op hangs) or nothing (for good)") from None
    if not threading.Event().wait(cap):
        raise InjectedFault(f"injected fault (hang@) in {op_name}: still running after {cap:g} s")


def _hog() -> None:
    """Touch 64 MiB blocks until the Nanny's memory monitor restarts this process."""
    blocks = []
    while True:
        blocks.append(bytearray(b"x" * (64 << 20)))
        time.sleep(0.02)
