"""The local cluster's layout chosen from the machine: `cluster.workers: auto` and
`cluster.torch_threads: auto` (what `configs/default.yaml` uses).

How many worker processes, and how many torch threads each, follows from how many of the team's
ops can run at once (its *width*) and the machine's cores:

- each agent's ops run one after another (rollout -> reward -> train -> step -> sync), so a team
  of n agents keeps at most n busy at once (dependency parallelism and the async pipeline
  overlap different agents), and `codesign.serial` keeps one;
- with `codesign.max_staleness` >= 1 an agent's next rollout runs beside its training, so each
  agent keeps two busy: generation and training overlap;
- workers = min(width, cores), threads = cores // workers: a core per op that can run, the rest
  as threads inside each op (torch's intra-op threads), never more threads than cores.

Agents take the workers' `rollout:<agent>` tags round-robin in team order, so agents next to
each other in the graph (which overlap under dependency parallelism) start on different
workers; with more workers than agents each agent gets several. Every worker holds a training
slot. The result, and why, is `cluster.layout`, printed at the start of the run.

Resolved when the config loads (before field validation, so every reader sees plain values) and
saved resolved in the run folder, so a resume keeps the layout it started with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

GIB = 1024**3
#: a worker's memory limit when the machine has room for it (WorkerConfig's default)
WORKER_MEMORY = 6 * GIB
#: the share of the machine's memory the workers' limits may add up to
MEMORY_SHARE = 0.8


#: cores the auto layout may use, where set (a share of a machine others use too)
CORES_ENV = "FLEXMARL_CORES"


#: how long the auto layout watches the machine for other work before it chooses
BUSY_SAMPLE_S = 0.3
#: a sample this recent is reused: a command that loads its config twice (the CLI checks it,
#: then the flow loads it) waits once and gets one layout
BUSY_REUSE_S = 10.0
_busy_sample: tuple[float, float] | None = None  # (monotonic time, busy cores)


def machine_cores() -> int:
    """Cores this run may use: `FLEXMARL_CORES` where set, else those this process may run on
    (its CPU affinity: a container's or taskset's share)."""
    if os.environ.get(CORES_ENV):
        try:
            return max(1, int(os.environ[CORES_ENV]))
        except ValueError:
            raise ValueError(f"{CORES_ENV}={os.environ[CORES_ENV]!r}: a whole number of cores") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def free_cores(*, look_when_set: bool = False) -> tuple[int, str]:
    """(cores the auto layout may use, what it left out and why, or ""): `machine_cores`, less
    (without `FLEXMARL_CORES`) the cores that processes this run would share them with keep
    busy, at least one kept. An OpenMP thread that shares its core with such a process waits
    at every barrier for it, so two threads beside a busy core run slower than one.
    `look_when_set`: `FLEXMARL_CORES` is a cap, and the busy cores still come off it (threads
    in this process; a layout it sets stays fixed)."""
    mine = machine_cores()
    if (os.environ.get(CORES_ENV) and not look_when_set) or mine == 1:
        return mine, ""
    global _busy_sample
    if _busy_sample is None or time.monotonic() - _busy_sample[0] > BUSY_REUSE_S:
        _busy_sample = (time.monotonic(), busy_elsewhere())
    busy = min(round(_busy_sample[1]), mine - 1)
    if busy <= 0:
        return mine, ""
    return mine - busy, f"; {busy} of {mine} cores busy with other work"


def look_again() -> None:
    """Forget the last look at the machine (`BUSY_REUSE_S`): the next auto layout looks again.
    For a caller that changed the machine's load since its last config load (a benchmark that
    starts its background work)."""
    global _busy_sample
    _busy_sample = None


@contextmanager
def torch_threads_on_free_cores(say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Torch work in this process outside the cluster (SFT in `flexmarl sft` or a run's warm
    start) on the cores the auto layout would use (`free_cores`) where torch's thread per core
    is more: beside a busy core an OpenMP thread waits at every barrier for the one that shares
    it (30 SFT steps of the tiny team took 363 s on two threads beside a spinning core, 24 s on
    one). `FLEXMARL_CORES` caps the count here and the busy cores still come off it (it fixes
    a layout, not where threads may wait). `say` gets the reason; torch's count is put back
    afterwards."""
    import torch

    before = torch.get_num_threads()
    cores, why = free_cores(look_when_set=True) if before > 1 else (1, "")  # one thread: nothing to look at
    if cores >= before:
        yield
        return
    if say is not None:
        say(f"{cores} torch thread{'s' if cores > 1 else ''}{why}")
    torch.set_num_threads(cores)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def busy_elsewhere(sample_s: float = BUSY_SAMPLE_S) -> float:
    """Cores that other processes this run would share them with (`_shares_with_me`) kept busy
    over `sample_s`; 0 where /proc does not say (not Linux)."""
    first, t0 = _cpu_ticks(), time.monotonic()
    if not first:
        return 0.0
    time.sleep(sample_s)
    last, t1 = _cpu_ticks(), time.monotonic()
    me = (_autogroup("self"), os.getpriority(os.PRIO_PROCESS, 0))
    # The run's own processes are not other work: its cluster starts while the config loads
    # again in the flow, and its workers' imports would count against the run's own layout.
    ours = descendants(os.getpid(), last)
    used = sum(ticks - first[pid][0] for pid, (ticks, nice, _) in last.items()
               if pid in first and pid not in ours and ticks > first[pid][0] and _shares_with_me(pid, nice, *me))
    return used / os.sysconf("SC_CLK_TCK") / max(t1 - t0, 1e-3)


def _autogroup(pid: int | str) -> tuple[str, int] | None:
    """The process's autogroup and that group's nice (None: autogroup scheduling off, or /proc
    does not say)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() != "1":
                return None
        with open(f"/proc/{pid}/autogroup") as f:
            name, _, nice = f.read().split()  # "/autogroup-12 nice 0"
        return name, int(nice)
    except (OSError, ValueError):
        return None


def _shares_with_me(pid: int, nice: int, my_group: tuple[str, int] | None, my_nice: int) -> bool:
    """Whether `pid` (at `nice`) takes cores this process (in `my_group`, at `my_nice`) would
    get. With autogroup scheduling on, the kernel shares the cores between sessions
    (autogroups) by each group's nice first: a process of another session counts when its
    group's nice is no higher than this one's, whatever its own (a terminal's test suite at
    nice 19 does; the Prefect server flexmarl starts, whose session runs at nice 10, does not).
    Within one session, or without autogroups, a process counts at this one's nice or better."""
    theirs = _autogroup(pid) if my_group is not None else None
    if my_group is not None and theirs is not None and theirs[0] != my_group[0]:
        return theirs[1] <= my_group[1]
    return nice <= my_nice


def descendants(pid: int, procs: dict[int, tuple[int, int, int]]) -> set[int]:
    """The processes of `procs` (`_cpu_ticks`) that `pid` started, and theirs, and so on."""
    found: set[int] = set()
    parents = {pid}
    while parents:
        parents = {p for p, (_, _, ppid) in procs.items() if ppid in parents and p not in found}
        found |= parents
    return found


def _cpu_ticks() -> dict[int, tuple[int, int, int]]:
    """(CPU ticks so far, user + system; nice; parent pid) of every other process."""
    own = os.getpid()
    out: dict[int, tuple[int, int, int]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid == own:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        fields = raw[raw.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces
        out[pid] = int(fields[11]) + int(fields[12]), int(fields[16]), int(fields[1])  # proc(5) 14, 15, 19, 4
    return out


def machine_memory() -> int:
    """Physical memory in bytes."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 4 * WORKER_MEMORY


def width(agents: int, *, serial: bool, max_staleness: int) -> int:
    """How many of the team's ops can run at once."""
    per_agent = 2 if max_staleness >= 1 else 1
    return per_agent if serial else per_agent * max(1, agents)


def _why(agents: int, serial: bool, max_staleness: int) -> str:
    who = "one agent" if agents == 1 else f"{agents} agents"
    if serial:
        who = f"{who} one at a time (codesign.serial)"
    if max_staleness >= 1:
        each = "" if agents == 1 or serial else " each"
        return f"{who}{each} rolling out beside its training (max_staleness {max_staleness})"
    return f"{who}, on-policy" if agents == 1 or serial else f"{who} at once"


def choose(agents: list[str], *, serial: bool, max_staleness: int, cores: int, memory: int,
           threads: int | None = None) -> tuple[list[dict[str, Any]], int, str]:
    """Workers (as config mappings), torch threads per worker and the reason, for `agents` on a
    machine of `cores` and `memory` bytes; `threads` fixed by the config, or None to choose."""
    w = width(len(agents), serial=serial, max_staleness=max_staleness)
    n = max(1, min(w, cores if threads is None else cores // threads))
    t = threads if threads is not None else max(1, cores // n)
    limit = min(WORKER_MEMORY, int(MEMORY_SHARE * memory / n))
    workers = []
    for j in range(n):
        mine = [a for i, a in enumerate(agents) if i % n == j] or [agents[j % len(agents)]]
        workers.append({"name": f"w{j}", "resources": {**{f"rollout:{a}": 1 for a in mine}, "train": 1},
                        "memory_limit": f"{limit / GIB:.2f}GiB"})
    return workers, t, _why(len(agents), serial, max_staleness)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _agent_names(team: Any) -> list[str]:
    return [str(_get(a, "name")) for a in (_get(team, "agents") or [])]


def resolve(data: Any, *, cores: int | None = None, memory: int | None = None) -> Any:
    """The raw config mapping with `cluster.workers: auto` / `cluster.torch_threads: auto`
    replaced by the chosen values and `cluster.layout` saying what they are and why; anything
    else is returned as it came (field validation then says what is wrong with it)."""
    if not isinstance(data, dict) or not isinstance(data.get("cluster"), dict):
        return data
    cluster = data["cluster"]
    auto_w, auto_t = cluster.get("workers") == "auto", cluster.get("torch_threads") == "auto"
    if not (auto_w or auto_t):
        return data
    names = _agent_names(data.get("team"))
    if not names:
        return data  # no team: field validation says so
    cores, busy = free_cores() if cores is None else (cores, "")
    codesign = data.get("codesign") or {}
    serial = bool(_get(codesign, "serial", False))
    staleness = _get(codesign, "max_staleness", 0)
    staleness = staleness if isinstance(staleness, int) else 0
    cluster = dict(cluster)
    if auto_w:
        fixed = cluster.get("torch_threads", 1)
        given = fixed if isinstance(fixed, int) else None  # "auto": chosen with the workers
        workers, threads, why = choose(names, serial=serial, max_staleness=staleness, cores=cores,
                                       memory=machine_memory() if memory is None else memory, threads=given)
        cluster["workers"], cluster["torch_threads"] = workers, threads
        how = "auto" if auto_t else "auto workers"
    else:
        given = cluster.get("workers")
        slots = sum(int(_get(w, "nthreads", 1) or 1) for w in given) if isinstance(given, list) and given else 2
        threads, why = max(1, cores // slots), f"{slots} worker thread{'s' if slots > 1 else ''} in cluster.workers"
        cluster["torch_threads"] = threads
        how = "auto torch threads"
    cluster["layout"] = f"{_shape(len(cluster['workers']), threads, cores)} ({how}: {why}{busy})"
    return {**data, "cluster": cluster}


def _shape(workers: int, threads: int, cores: int) -> str:
    return (f"{workers} worker{'s' if workers > 1 else ''} x {threads} torch thread{'s' if threads > 1 else ''} "
            f"on {cores} core{'s' if cores > 1 else ''}")


def line(cluster: Any, cores: int | None = None) -> str | None:
    """The run's first line about where it runs: the local cluster's layout and why (None for a
    cluster at an address, whose layout is its own)."""
    if cluster.address is not None:
        return None
    if cluster.layout:
        return f"layout: {cluster.layout}"
    cores = machine_cores() if cores is None else cores
    return (f"layout: {_shape(len(cluster.workers), cluster.torch_threads, cores)} "
            "(set in cluster.workers and cluster.torch_threads)")
