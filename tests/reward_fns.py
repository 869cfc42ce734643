"""User-style reward callables for tests (imported by name, also inside Dask workers)."""

from __future__ import annotations

from collections.abc import Mapping


def varied(problem: object, outputs: Mapping[str, str]) -> float:
    """A reward that differs between samples even for untrained models (digits and length of
    the team's texts), so GRPO advantages are non-zero and every agent really trains."""
    text = "".join(outputs.values())
    return sum(c.isdigit() for c in text) / (1 + len(text)) + 0.01 * len(text)


def lowercase(problem: object, outputs: Mapping[str, str]) -> float:
    """Easy to learn from scratch: the share of a-z characters in the team's outputs (an
    untrained model scores ~0.6, so every group has spread to learn from)."""
    text = "".join(outputs.values())
    return sum("a" <= c <= "z" for c in text) / max(len(text), 1)


def hangs_on_one(problem: object, outputs: Mapping[str, str]) -> float:
    """`varied`, except that it never returns for one input of iteration 0 (`a0t1`, the
    arithmetic workload's second problem): a reward that hangs on one input."""
    import time

    if getattr(problem, "input_id", "") == "a0t1":
        time.sleep(1000)
    return varied(problem, outputs)


def always_hangs(problem: object, outputs: Mapping[str, str]) -> float:
    """A broken reward: it never returns."""
    import time

    time.sleep(1000)
    return 0.0


#: `<sha256 of canary A> <sha256 of canary B>`: what `canaries_delivered` checks its worker's
#: FLEXMARL_CANARY_A and FLEXMARL_CANARY_B against (tests/slow/test_secrets_canary.py)
CANARY_DIGESTS_ENV = "FLEXMARL_CANARY_SHA256"


def canaries_delivered(problem: object, outputs: Mapping[str, str]) -> float:
    """`varied`, but it raises (failing the run) unless this worker's FLEXMARL_CANARY_A and
    FLEXMARL_CANARY_B, set by `cluster.worker_env` references, hash to the digests in
    `CANARY_DIGESTS_ENV`: the secrets reached the worker, and only digests travel beside them."""
    import hashlib
    import os

    want = os.environ[CANARY_DIGESTS_ENV].split()
    names = ("FLEXMARL_CANARY_A", "FLEXMARL_CANARY_B")
    wrong = [n for n, w in zip(names, want, strict=True)
             if hashlib.sha256(os.environ.get(n, "").encode()).hexdigest() != w]
    if wrong:
        raise RuntimeError(f"{wrong} in this worker do not hold the planted canaries")
    return varied(problem, outputs)
