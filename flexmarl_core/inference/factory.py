"""`make_inference_engine`: the rollout engine an agent's config asks for."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flexmarl_core.config import AgentConfig
from flexmarl_core.inference.api import InferenceBackend
from flexmarl_core.inference.hf import HFInferenceEngine
from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine  # imports vllm only when used


def make_inference_engine(
    agent: AgentConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> InferenceBackend:
    """An engine for `agent`: the HF engine owns `model` (cast to `agent.model.dtype` in place);
    the vLLM engine loads a copy of its weights (vllm extra, `vllm_engine.py`)."""
    backend = agent.backend.inference
    if backend == "vllm":
        # vLLM loads from a folder: the model's current weights are saved to a private one.
        return VLLMInferenceEngine.from_model(model, tokenizer, dtype=agent.model.dtype)
    if backend != "hf":
        raise ValueError(f"agent {agent.name!r}: unknown backend.inference={backend!r}; valid: hf, vllm")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[agent.model.dtype]
    return HFInferenceEngine(model.to(dtype), tokenizer)
