"""A sandbox for model-generated code: run this code against these tests, within these limits.

    from flexmarl_core.sandbox import Limits, run_tests
    v = run_tests("def f(x):\n    return x + 1", ["assert candidate(1) == 2"], entry="f")
    v.passed, v.total, v.reason, v.reward

Each program gets its own process (namespaces, rlimits, an unprivileged uid, an audit hook);
the verdict is decided in the caller's process (see `runner`). `protections()` says which
protections this machine allows.
"""

from flexmarl_core.sandbox.api import FATAL, Limits, Reason, SandboxError, Verdict
from flexmarl_core.sandbox.runner import CandidateError, protections, run_tests, set_concurrency

__all__ = [
    "FATAL",
    "CandidateError",
    "Limits",
    "Reason",
    "SandboxError",
    "Verdict",
    "protections",
    "run_tests",
    "set_concurrency",
]
