"""What the parts a worker composes may use of it: `WorkerView`, which the worker's context
(`runtime/worker.py` `WorkerContext`) satisfies. Trainer kinds, estimator scopes and the
program machinery are typed against it, so none of them imports the worker's composition root,
which imports them: the worker sits above its parts, as `teams/api.py` `RunView` does for team
shapes."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.inference import InferenceBackend
    from flexmarl_core.meg import MEG
    from flexmarl_core.runfiles.location import RunLocation
    from flexmarl_core.teams.api import TeamShape
    from flexmarl_core.training import TrainBackend
    from flexmarl_core.training.api import GradientTrainer
    from storage import Store


class WorkerView(Protocol):
    """One run's state in one worker process: its files, config, team, store and the engines
    and trainers it holds."""

    loc: RunLocation
    cfg: ExperimentConfig
    team: TeamShape
    #: one stage at a time touches the engines and trainers of this process
    lock: threading.RLock
    #: (iteration, micro-batch) pairs each agent's trainer holds the gradients of
    accumulated: dict[str, set[tuple[int, int]]]
    #: shared LoRA bases the trainers of this process train adapters on, by base
    shared_train_bases: dict[str, Any]

    @property
    def meg(self) -> MEG: ...

    @property
    def store(self) -> Store: ...

    def inputs(self, iteration: int, mb: int) -> list[dict[str, Any]]: ...

    def engine(self, agent: str, version: int) -> InferenceBackend: ...

    def trainer(self, agent: str, version: int) -> tuple[TrainBackend, dict[str, float]]: ...

    def helper(self, agent: str, version: int) -> GradientTrainer: ...

    def fresh_model(self, agent: str) -> tuple[Any, Any]: ...
