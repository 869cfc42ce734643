"""The parent side: start a sandboxed child per program, run the tests here, decide the verdict.

The tests never enter the child. Each test is Python run in this process with `candidate`
bound to a proxy; a call sends the (encoded) arguments over a pipe and the child answers with
the encoded return value, which decodes to a plain builtin. So the only thing a program can do
to pass a test is return the right value: printing "PASS", exiting 0, patching builtins or
assert, or raising SystemExit changes nothing here. Tests are trusted code (the workload's
hidden tests, a dataset's `check`); the candidate is not.
"""

from __future__ import annotations

import builtins
import errno
import functools
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexmarl_core.sandbox import child
from flexmarl_core.sandbox.api import FATAL, Limits, Reason, SandboxError, Verdict

# From the module's loader, not its __file__: flexmarl may be imported from a zip that
# `cluster.upload` shipped to a Dask worker.
_SOURCE = child.__loader__.get_source(child.__name__) or Path(child.__file__).read_text()
_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
#: how long the interpreter may take to come up; the program's `wall_s` starts after it (a slow
#: start is the machine's, not the program's)
START_S = 30.0
#: tries to start a process when the kernel says EAGAIN/ENOMEM (a passing squeeze)
_SPAWN_TRIES = 3
_slots = threading.BoundedSemaphore(os.cpu_count() or 1)
_slots_lock = threading.Lock()


def set_concurrency(n: int) -> None:
    """At most `n` sandboxed programs at once in this process (a Dask worker: its reward
    threads share it). Default: the machine's cores."""
    global _slots
    if n < 1:
        raise ValueError(f"sandbox concurrency must be >= 1, got {n}")
    with _slots_lock:
        _slots = threading.BoundedSemaphore(n)


class CandidateError(Exception):
    """The candidate's function raised (the message is its exception's); a test fails."""


class _Ended(BaseException):
    """The child is gone or must go; BaseException so a test's `except Exception` keeps it."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _ready(fd: int, event: int, deadline: float) -> bool:
    """Wait for `fd` until `deadline` (poll, not select: a busy worker may hold >1024 fds).
    A closed peer (POLLHUP/POLLERR) counts as ready: the read or write then says so."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(left * 1000))


@functools.lru_cache(maxsize=8)
def _interpreter(python: str | None) -> tuple[str, str]:
    """(interpreter, its base prefix): the boot stage binds the prefix back read-only once the
    hidden folders are covered. Raises `SandboxError` for an interpreter that does not run."""
    if python is None:
        return _PYTHON, os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(python)
    try:
        out = subprocess.run([exe, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"],
                             capture_output=True, text=True, timeout=START_S, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"the sandbox cannot start programs: interpreter {python!r}: {exc}") from None
    if out.returncode != 0 or not out.stdout.strip():
        raise SandboxError(f"the sandbox cannot start programs: interpreter {python!r} exited "
                           f"{out.returncode}: {out.stderr.strip()[-300:]}")
    return exe, os.path.realpath(out.stdout.strip())


class _Child:
    """One sandboxed process and its two pipes (requests in, replies out). `deadline` bounds
    the start until `started` moves it to `wall_s` from then."""

    def __init__(self, limits: Limits, deadline: float) -> None:
        self.limits, self.deadline = limits, deadline
        python, prefix = _interpreter(limits.python)
        self.req_r, self.req_w = os.pipe()
        self.resp_r, self.resp_w = os.pipe()
        self.buf = b""
        self.killed_for: Reason | None = None
        #: the program's own peak RSS (its image after exec), read just before the kill
        self.peak_mb: float | None = None
        uid = 1_000_000 + secrets.randbelow(2**30)
        hide = sorted({str(Path.cwd()), str(Path.home()), "/root", "/home", *limits.hide})
        cfg = {
            "uid": uid, "req": self.req_r, "resp": self.resp_w, "python": python,
            "prefix": prefix, "hide": hide, "source": _SOURCE, "disk_bytes": limits.disk_mb << 20,
            "limits": {"cpu": max(1, math.ceil(limits.cpu_s)), "memory": limits.memory_mb << 20,
                       "processes": limits.processes + limits.threads, "files": limits.open_files,
                       "output": limits.output_bytes},
        }
        for attempt in range(_SPAWN_TRIES):
            try:
                self.proc = subprocess.Popen(
                    [python, "-I", "-S", "-B", "-c", _SOURCE, "boot", json.dumps(cfg)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    pass_fds=(self.req_r, self.resp_w), start_new_session=True, env={},
                )
                break
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.ENOMEM) and attempt + 1 < _SPAWN_TRIES:
                    time.sleep(0.1 * 2**attempt)
                    continue
                for fd in (self.req_r, self.req_w, self.resp_r, self.resp_w):
                    os.close(fd)
                raise SandboxError(f"the sandbox cannot start programs: {python}: {exc}") from None
        os.close(self.req_r)
        os.close(self.resp_w)
        os.set_blocking(self.req_w, False)
        self.boot: dict[str, Any] = {}
        self.started = False

    def start(self) -> None:
        """Wait for the boot report and the harness's hello; the program's wall time starts
        now. A child that dies or hangs before that raises `_Ended` with `started` False."""
        self.boot = self.recv()
        self.recv()
        self.started = True
        self.deadline = time.monotonic() + self.limits.wall_s

    def send(self, obj: Any) -> None:
        """Write one frame, never blocking past the deadline (a program that stops reading
        must not stall the worker on a full pipe)."""
        data = json.dumps(obj).encode()
        data = len(data).to_bytes(4, "big") + data
        while data:
            if not _ready(self.req_w, select.POLLOUT, self.deadline):
                self.kill("timeout")
                raise _Ended("timeout", f"wall time {self.limits.wall_s:g}s ran out")
            try:
                data = data[os.write(self.req_w, data):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise _Ended("exited", "the process closed its request pipe") from None

    def recv(self) -> dict[str, Any]:
        while True:
            if len(self.buf) >= 4:
                n = int.from_bytes(self.buf[:4], "big")
                if n > child.MAX_FRAME:
                    self.kill("bad_reply")
                    raise _Ended("bad_reply", f"a reply frame of {n} bytes")
                if len(self.buf) >= 4 + n:
                    raw, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    try:
                        msg = json.loads(raw)
                    except (ValueError, RecursionError):
                        msg = None
                    if not isinstance(msg, dict):
                        self.kill("bad_reply")
                        raise _Ended("bad_reply", "a reply that is not a JSON object")
                    if "forbidden" in msg:
                        raise _Ended("forbidden", str(msg["forbidden"])[:300])
                    return msg
            if not _ready(self.resp_r, select.POLLIN, self.deadline):
                self.kill("timeout")
                raise _Ended("timeout", f"wall time {self.limits.wall_s:g}s ran out")
            chunk = os.read(self.resp_r, 1 << 16)
            if not chunk:
                raise _Ended("exited", "the process ended")
            self.buf += chunk

    def kill(self, why: Reason | None) -> None:
        """End the whole session; `why` records that the parent (not the program) ended it."""
        self.killed_for = self.killed_for or why
        if self.peak_mb is None:
            self.peak_mb = _peak_rss_mb(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> tuple[int, Any]:
        for fd in (self.req_w, self.resp_r):
            os.close(fd)
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        err = self.proc.stderr.read(4000) if self.proc.stderr else b""
        if self.proc.stderr:
            self.proc.stderr.close()
        self.stderr = err.decode(errors="replace").strip()
        if self.boot and not self.boot.get("private") and self.boot.get("work"):
            shutil.rmtree(self.boot["work"], ignore_errors=True)
        return status, usage


def _peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a live process. Not rusage: a forked child's ru_maxrss keeps the parent's
    footprint (a worker with torch loaded would read as a 400 MB program)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class _Proxy:
    """`candidate` inside the tests: a call runs in the child and returns a decoded value."""

    def __init__(self, ch: _Child, fn: str) -> None:
        self.ch, self.fn = ch, fn

    def __call__(self, *args: Any) -> Any:
        try:
            encoded = child.encode(list(args))
        except TypeError as exc:
            raise CandidateError(f"the test passes an argument the sandbox cannot send: {exc}") from None
        self.ch.send({"fn": self.fn, "args": encoded})
        reply = self.ch.recv()
        if "raised" in reply:
            msg = str(reply["raised"])
            _raise_if_limit(self.ch, msg)
            raise CandidateError(msg)
        if "ok" not in reply:
            self.ch.kill("bad_reply")
            raise _Ended("bad_reply", f"unexpected reply keys {sorted(reply)[:5]}")
        try:
            return child.decode(reply["ok"])
        except (ValueError, TypeError, RecursionError) as exc:
            self.ch.kill("bad_reply")
            raise _Ended("bad_reply", f"an undecodable value: {exc}") from None


def _raise_if_limit(ch: _Child, msg: str) -> None:
    """An exception that means a limit was hit ends the program even if the code caught it
    once: Python ignores SIGXFSZ, so the output cap shows as EFBIG (errno 27)."""
    if msg.startswith("MemoryError"):
        ch.kill("memory_limit")
        raise _Ended("memory_limit", f"MemoryError under {ch.limits.memory_mb} MB")
    if "[Errno 27]" in msg:
        ch.kill("output_limit")
        raise _Ended("output_limit", f"output over {ch.limits.output_bytes} bytes ({msg[:80]})")


def _ended_by_status(status: int, cpu_s: float, limits: Limits) -> tuple[Reason, str]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= math.ceil(limits.cpu_s)):
            return "cpu_limit", f"CPU time {cpu_s:.2f}s over {limits.cpu_s:g}s"
        if sig == signal.SIGXFSZ:
            return "output_limit", f"output over {limits.output_bytes} bytes"
        return "exited", f"killed by signal {signal.Signals(sig).name}"
    code = os.WEXITSTATUS(status)
    if code == child.FORBIDDEN_EXIT:
        return "forbidden", "ended by the audit hook"
    return "exited", f"exit status {code} during the tests"


def run_tests(
    code: str,
    tests: Sequence[str],
    limits: Limits | None = None,
    *,
    entry: str = "candidate",
    prelude: str = "",
) -> Verdict:
    """Run `code` in a sandbox and each of `tests` here against its function `entry`.

    A test is Python source run with `candidate` (and `entry`) bound to that function, and
    every other function the code defines bound by its name unless that shadows a builtin or a
    prelude name (their arguments and return values cross the pipe, so they must be builtin
    values: numbers, str, bytes, lists, tuples, sets, dicts); it passes when it raises nothing. `prelude` is trusted source run
    first in the tests' namespace (a HumanEval prompt's helpers).
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    tests = list(tests)
    if not all(isinstance(t, str) for t in tests):
        raise TypeError("every test must be a str of Python source")
    limits = limits or Limits()
    results = [False] * len(tests)
    base: dict[str, Any] = {"__builtins__": builtins}
    if prelude:
        exec(compile(prelude, "<prelude>", "exec"), base)
    with _slots:
        start = time.monotonic()
        ch = _Child(limits, start + START_S)
        reason: Reason = "passed"
        detail = ""
        try:
            ch.start()
            ch.send({"code": code})
            loaded = ch.recv()
            if "load_error" in loaded:
                msg = str(loaded["load_error"])[:300]
                _raise_if_limit(ch, msg)
                raise _Ended("load_error", msg)
            proxy = _Proxy(ch, entry)
            # The code's other functions by their names, as HumanEval's harness sees them, but
            # never in place of a builtin or a prelude name: a test's own `abs` stays Python's.
            helpers = {f: _Proxy(ch, f) for f in loaded.get("functions", [])
                       if isinstance(f, str) and f.isidentifier() and f not in base and not hasattr(builtins, f)}
            for i, test in enumerate(tests):
                ns = dict(base, **helpers, candidate=proxy)
                ns[entry] = proxy  # a HumanEval check may call the function by its own name
                try:
                    exec(compile(test, f"<test {i}>", "exec"), ns)
                    results[i] = True
                except Exception as exc:  # noqa: BLE001 - any error in a test fails that test
                    if not detail:
                        detail = f"test {i}: {type(exc).__name__}: {exc}"[:300]
            ch.kill("passed")  # done: the session goes, whatever it left running
        except _Ended as end:
            reason, detail = end.reason, end.detail
        finally:  # also on an error in the caller's thread: never leave a program running
            ch.kill(None)
            status, usage = ch.reap()
    wall = time.monotonic() - start
    cpu = usage.ru_utime + usage.ru_stime
    if not ch.started:  # the program never ran: no verdict to give
        why = ch.stderr[-300:] or (detail if reason == "timeout" else _ended_by_status(status, cpu, limits)[1])
        if reason == "timeout":
            why = f"the interpreter did not come up within {START_S:g} s ({why})"
        raise SandboxError(f"the sandbox cannot start programs: {why}")
    if reason == "exited" and ch.killed_for is None:
        reason, detail = _ended_by_status(status, cpu, limits)
    if reason in FATAL:
        results = [False] * len(tests)
    elif not all(results):
        reason = "failed"
    return Verdict(
        passed=sum(results), total=len(tests), reason=reason, detail=detail, wall_s=wall,
        cpu_s=cpu, memory_mb=ch.peak_mb or 0.0, results=tuple(results),
    )


_protections: dict[str, str] | None = None


def protections() -> dict[str, str]:
    """Which protections are on here and which are off (and why): one probe run, cached."""
    global _protections
    if _protections is None:
        with _slots:
            try:
                ch = _Child(Limits(), time.monotonic() + START_S)
            except SandboxError as exc:
                return {"sandbox": f"off: {exc}"}
            try:
                ch.start()
                boot = ch.boot
            except _Ended as end:
                boot = {"boot": {"sandbox": f"off: did not start ({end.detail})"}}
            ch.kill("passed")
            ch.reap()
        report = dict(boot.get("boot", {}))
        report.update({
            "limits": "on: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_FSIZE; "
                      "wall time by killing the session",
            "verdict": "on: tests run in the parent; only returned values cross the pipe",
            "audit hook": "on: fork/exec/socket/ctypes/signals/files outside end the program",
            "environment": "on: isolated interpreter (-I -S), empty environment",
            "pid namespace": "off: other processes are visible in /proc (not hidden)",
        })
        _protections = report
    return dict(_protections)
