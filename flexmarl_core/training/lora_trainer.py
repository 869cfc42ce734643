"""A trainer for one LoRA agent on a `SharedBase`; several agents' trainers share one base.

It is the plain torch trainer with the agent's adapter as its only trainable parameters: the
flat buffers (weights, gradients, both Adam moments) hold the adapter alone, so `state()` is
adapter + optimizer state (no base weights: every process loads the base from the run folder
once), and `weights()` is what a sync publishes. Before each forward the agent's adapter is
made the active, trainable one; the base and every other agent's adapter are frozen, so a
backward puts gradients into this agent's adapter only.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from flexmarl_core.models.lora import SharedBase
from flexmarl_core.training.api import MicroBatch, TrainerOptions
from flexmarl_core.training.torch_trainer import TorchTrainer


class LoraTrainer(TorchTrainer):
    def __init__(self, shared: SharedBase, agent: str, opts: TrainerOptions, **kwargs: Any) -> None:
        if kwargs.get("ref_model") is not None:
            raise ValueError(f"agent {agent!r}: a LoRA trainer has no KL reference (algorithm.kl_coef must be 0)")
        self.shared, self.agent = shared, agent
        shared.activate(agent, trainable=True)  # only its tensors require grad: they get flattened
        super().__init__(shared.model, opts, **kwargs)
        # PeftModel.forward takes **kwargs; the base's own signature says whether it crops logits.
        self._keep_ok = "logits_to_keep" in inspect.signature(shared.base.forward).parameters

    def _flatten_params(self) -> None:
        super()._flatten_params()
        mine = {id(p) for _, p in self.shared.adapter_params(self.agent)}
        if {id(p) for p in self._params} != mine:
            raise RuntimeError(f"agent {self.agent!r}: trainable parameters are not exactly its adapter")
        self._others = []  # the base and other agents' adapters are not this trainer's state

    def _policy(self) -> torch.nn.Module:
        self.shared.activate(self.agent, trainable=True)
        return self.model

    def logprobs(self, micro_batch: MicroBatch) -> list[list[float]]:
        self.shared.activate(self.agent, trainable=True)
        return super().logprobs(micro_batch)

    def weights(self, *, copy: bool = True) -> dict[str, torch.Tensor]:  # always copies
        """The adapter (keys without the agent's name), which engines on any process load."""
        return self.shared.adapter_state(self.agent)
