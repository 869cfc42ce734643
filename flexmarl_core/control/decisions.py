"""Typed records of every control-plane decision, in the order they were made.

Each has a `decision` name (the `decision` column of `metrics/decisions.jsonl` and of the
run's `-decisions` artifact) and `as_row()` for JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar


def _finite(d: dict[str, float]) -> dict[str, Any]:
    return {k: (v if math.isfinite(v) else "inf") for k, v in d.items()}


@dataclass(frozen=True, slots=True)
class MoveInstance:
    """Inter-agent balancing: `worker` starts serving `to_agent` (and stops serving
    `from_agent`, unless None: the worker is then shared)."""

    decision: ClassVar[str] = "move_instance"
    t: float
    worker: str
    to_agent: str
    from_agent: str | None
    #: seconds of queued rollout work per instance, per agent, that the move was decided on
    loads: dict[str, float]
    #: bytes of weights the worker must load for `to_agent` (the move's cost)
    cost_bytes: int
    monitor_us: float
    decide_us: float

    def as_row(self) -> dict[str, Any]:
        return {"decision": self.decision, **asdict(self), "loads": _finite(self.loads)}


@dataclass(frozen=True, slots=True)
class TrainSlot:
    """On-demand allocation: `agent`'s training of `iteration` goes to `worker`; `swap` when
    its state was last on another worker (it is swapped in from the checkpoint tier)."""

    decision: ClassVar[str] = "train_slot"
    t: float
    agent: str
    iteration: int
    worker: str
    state_was_on: str | None
    swap: bool
    #: ops outstanding and seconds of work charged to each slot when the choice was made
    loads: dict[str, int]
    work_s: dict[str, float]

    def as_row(self) -> dict[str, Any]:
        return {"decision": self.decision, **asdict(self)}


@dataclass(frozen=True, slots=True)
class GradientHelper:
    """`codesign.gradient_helpers`: `agent`'s train op of (`iteration`, `mb`) runs on the idle
    slot `worker` as a gradient helper, because `slot`, where the agent's trainer is, still has
    `queued` ops outstanding."""

    decision: ClassVar[str] = "gradient_helper"
    t: float
    agent: str
    iteration: int
    mb: int
    worker: str
    slot: str
    queued: int

    def as_row(self) -> dict[str, Any]:
        return {"decision": self.decision, **asdict(self)}


@dataclass(frozen=True, slots=True)
class Resubmit:
    """An op whose worker died is routed and submitted again (every stage is idempotent)."""

    decision: ClassVar[str] = "resubmit"
    t: float
    op: str
    worker: str | None
    error: str

    def as_row(self) -> dict[str, Any]:
        return {"decision": self.decision, **asdict(self)}


@dataclass(frozen=True, slots=True)
class HungOp:
    """An op ran past its deadline (`cluster.deadlines`) without ending or failing: it was
    cancelled, `worker` (the one running it) restarted, and the op submitted again. `op`: its
    name, or a fused run's names joined by ` + ` (one Dask task ran them all)."""

    decision: ClassVar[str] = "hung_op"
    t: float
    op: str
    worker: str
    deadline_s: float
    waited_s: float

    def as_row(self) -> dict[str, Any]:
        return {"decision": self.decision, **asdict(self)}


@dataclass(frozen=True, slots=True)
class StoreRetries:
    """`op` ended well after its worker retried `retries` transient object-store failures
    (`store.retries`) while it ran."""

    decision: ClassVar[str] = "store_retries"
    t: float
    op: str
    worker: str
    retries: int

    def as_row(self) -> dict[str, Any]:
        return {"decision": self.decision, **asdict(self)}


Decision = MoveInstance | TrainSlot | GradientHelper | Resubmit | HungOp | StoreRetries
