"""The sandbox's small API: limits in, a typed verdict out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: why a run ended the way it did; every reason but "passed" and "failed" scores 0. A sandbox
#: that cannot start the program at all is no verdict: `run_tests` raises `SandboxError`.
Reason = Literal[
    "passed",        # every test passed
    "failed",        # the program ran; some tests failed (wrong value or an exception)
    "load_error",    # the code does not compile or its top level raised
    "timeout",       # wall time ran out (an infinite loop, a sleep): the session was killed
    "cpu_limit",     # RLIMIT_CPU (SIGXCPU / SIGKILL)
    "memory_limit",  # RLIMIT_AS: a MemoryError, or killed while allocating
    "output_limit",  # RLIMIT_FSIZE on its stdout/stderr file (SIGXFSZ)
    "forbidden",     # the audit hook ended it: fork, exec, socket, ctypes, signals, files outside
    "exited",        # the process ended during the tests (os._exit, sys.exit at top level...)
    "bad_reply",     # it wrote something on the result pipe that is not a reply frame
]
FATAL: frozenset[str] = frozenset(
    {"timeout", "cpu_limit", "memory_limit", "output_limit", "forbidden", "exited", "bad_reply",
     "load_error"}
)


class SandboxError(RuntimeError):
    """The sandbox could not start a program (no interpreter, a limit Python cannot start
    under, no process to be had): flexmarl's machinery failed, not the program, so it is never
    a wrong answer. Not retryable: the next program would fail alike, so the run stops here."""

    retryable = False


@dataclass(frozen=True)
class Limits:
    """Per-program limits. `cpu_s` is RLIMIT_CPU (whole seconds, rounded up), `wall_s` covers
    start, load and every test; `threads` is how many threads the program may start besides
    its own (RLIMIT_NPROC is `processes + threads`: library code that starts a helper thread
    passes, a thread bomb stops at the cap); `hide` adds folders (a run folder, a store) to the
    ones the program never sees (the caller's working directory and home are always hidden);
    `python` is the interpreter it runs under (default: this process's base interpreter)."""

    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 512
    processes: int = 1
    threads: int = 4
    open_files: int = 32
    output_bytes: int = 1 << 20
    disk_mb: int = 16
    hide: tuple[str, ...] = ()
    python: str | None = None

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "open_files", "output_bytes",
                     "disk_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)} must be > 0")
        if self.threads < 0:
            raise ValueError(f"Limits.threads={self.threads} must be >= 0")
        if self.memory_mb < 64:
            raise ValueError(f"Limits.memory_mb={self.memory_mb} is too small to start Python (>= 64)")


@dataclass(frozen=True)
class Verdict:
    """What happened to one program, decided by the parent. `results[i]` is test i; after a
    fatal reason every test counts as failed, so `reward` is 0. `memory_mb` is the program's
    peak resident memory (0 when it was gone before it could be read)."""

    passed: int
    total: int
    reason: Reason
    detail: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    memory_mb: float = 0.0
    results: tuple[bool, ...] = field(default=())

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0
