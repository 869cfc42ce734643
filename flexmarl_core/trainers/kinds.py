"""The trainer-kind seam: what a trainer of one kind does in its ops, chosen once per trainer.

A run's trainers are its trainable agents' policies (`policy.py`) and, with GAE, its critics
(`critic.py`); `config.critic.trainer_kinds` says which name is which. The train, step and
sync stages and the worker's trainer cache call the kind's methods and never ask what it is.
A new kind is one module with a class registered here (`register_trainer_kind`), plus its
name in `trainer_kinds`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from flexmarl_core.algorithms.registry import Registry

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.ops import Op, StageResult
    from flexmarl_core.runtime.view import WorkerView
    from flexmarl_core.training.api import TrainBackend


class Stepped(NamedTuple):
    """What a step did: its grad norm, the micro-batches accumulated again and those added from a
    gradient helper, and metrics of the kind (a critic's explained variance)."""

    grad_norm: float
    missing: list[int]
    helped: list[int]
    metrics: dict[str, float]


class AuditCheck(NamedTuple):
    """A status column every sample of a completed iteration must have set, the problem's kind
    when one does not, and what that means (`driver/audit.py`)."""

    column: str
    kind: str
    what: str


class TrainerKind(Protocol):
    """One kind of trainer (see the module docstring)."""

    #: its sync hands the new weights to rollout instances (a critic serves none)
    serves_instances: bool

    def audited(self, cfg: ExperimentConfig, name: str) -> dict[str, list[AuditCheck]]:
        """Agent -> what the audit checks on its samples once trainer `name` completed an
        iteration."""
        ...

    def new_trainer(self, ctx: WorkerView, name: str) -> TrainBackend:
        """`name`'s trainer at version 0 in this process."""
        ...

    def train(self, ctx: WorkerView, op: Op) -> StageResult:
        """A train op: one micro-batch's backward into the trainer's accumulated gradients."""
        ...

    def step(self, ctx: WorkerView, name: str, tr: TrainBackend, it: int, *,
             replaying: bool = False) -> Stepped:
        """Step `tr` from version `it` (first accumulating any micro-batch whose gradient is not
        in it), in a step op or, `replaying`, to redo a step after a restart. Call with
        `ctx.lock` held."""
        ...


TRAINER_KINDS: Registry[Any] = Registry("trainer kind", "config.critic.trainer_kinds")


def register_trainer_kind(name: str) -> Any:
    """Class decorator: registers one instance of the class under `name`."""
    def deco(cls: type) -> type:
        TRAINER_KINDS.register(name)(cls())
        return cls
    return deco
