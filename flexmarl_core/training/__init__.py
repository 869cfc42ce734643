"""Training engine: one trainer per agent, plus location-agnostic state handles."""

from flexmarl_core.training.api import (
    LossFn,
    LossWeightFn,
    MicroBatch,
    Sample,
    StepResult,
    TokenBatch,
    TrainBackend,
    TrainerOptions,
)
from flexmarl_core.training.collate import collate, global_loss_scale
from flexmarl_core.training.factory import make_trainer, options_for
from flexmarl_core.training.handles import StateHandle, drop, get, put
from flexmarl_core.training.torch_trainer import TorchTrainer

__all__ = [
    "LossFn",
    "LossWeightFn",
    "MicroBatch",
    "Sample",
    "StateHandle",
    "StepResult",
    "TokenBatch",
    "TorchTrainer",
    "TrainBackend",
    "TrainerOptions",
    "collate",
    "drop",
    "get",
    "global_loss_scale",
    "make_trainer",
    "options_for",
    "put",
]
