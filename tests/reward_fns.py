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
