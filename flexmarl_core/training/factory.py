"""`make_trainer`: the trainer an agent's config asks for."""

from __future__ import annotations

import copy
from typing import Any

from transformers import PreTrainedModel

from flexmarl_core.algorithms.losses import make_loss_fn, token_weight
from flexmarl_core.config import AgentConfig
from flexmarl_core.training.api import LossFn, LossWeightFn, TrainBackend, TrainerOptions
from flexmarl_core.training.deepspeed_trainer import DeepSpeedTrainer
from flexmarl_core.training.dp_trainer import DataParallelDeepSpeedTrainer
from flexmarl_core.training.lora_trainer import LoraTrainer
from flexmarl_core.training.torch_trainer import TorchTrainer


def options_for(agent: AgentConfig, *, loss_fn: LossFn | None = None,
                loss_weight_fn: LossWeightFn | None = None) -> TrainerOptions:
    """`agent`'s trainer options: the policy loss `agent.algorithm.policy_loss` normalised per
    global-batch token (`algorithms.make_loss_fn` + `token_weight`) unless given, its optimizer
    settings, and logprobs scored at its sampling temperature, matching the rollout engine."""
    algo = agent.algorithm
    return TrainerOptions(loss_fn=loss_fn or make_loss_fn(algo), loss_weight_fn=loss_weight_fn or token_weight,
                          lr=algo.lr, lr_warmup_steps=algo.lr_warmup_steps, weight_decay=algo.weight_decay,
                          max_grad_norm=algo.max_grad_norm, bf16=algo.bf16,
                          temperature=agent.sampling.temperature, packing=agent.backend.packing,
                          share_prefix=agent.backend.share_prefix)


def make_trainer(
    agent: AgentConfig,
    model: PreTrainedModel,
    *,
    loss_fn: LossFn | None = None,
    loss_weight_fn: LossWeightFn | None = None,
    ref_model: PreTrainedModel | None = None,
) -> TrainBackend:
    """A trainer for `agent` that owns `model` (fp32 master weights), set up with
    `options_for(agent)`. With `algorithm.kl_coef > 0` a frozen copy of `model` becomes the KL
    reference unless `ref_model` is given. backend.training='deepspeed' gives a
    `DeepSpeedTrainer` (ZeRO-2, deepspeed extra), or with backend.training_dp > 1 a
    `DataParallelDeepSpeedTrainer` over that many rank processes (then `loss_fn` and
    `loss_weight_fn` must pickle)."""
    backend = agent.backend.training
    if backend not in ("torch", "deepspeed"):
        raise ValueError(f"agent {agent.name!r}: unknown backend.training={backend!r}; valid: torch, deepspeed")
    opts = options_for(agent, loss_fn=loss_fn, loss_weight_fn=loss_weight_fn)
    ref = (ref_model or copy.deepcopy(model)) if agent.algorithm.kl_coef > 0 else None
    if backend == "torch":
        return TorchTrainer(model, opts, ref_model=ref, chunk_tokens=agent.backend.train_chunk_tokens,
                            activation_checkpointing=agent.backend.activation_checkpointing)
    if agent.backend.training_dp > 1:
        return DataParallelDeepSpeedTrainer(model, opts, name=agent.name, dp=agent.backend.training_dp,
                                            ref_model=ref)
    return DeepSpeedTrainer(model, opts, ref_model=ref)


def make_lora_trainer(agent: AgentConfig, shared: Any) -> TrainBackend:
    """A `LoraTrainer` for `agent`'s adapter on `shared` (a `models.lora.SharedBase` holding it),
    with the same options as `make_trainer`."""
    return LoraTrainer(shared, agent.name, options_for(agent),
                       chunk_tokens=agent.backend.train_chunk_tokens,
                       activation_checkpointing=agent.backend.activation_checkpointing)
