"""Inference engine: batched sampling with exact per-token logprobs and weight updates.

The engines (`factory.py`, `hf.py`) load on first use: the contracts in `api.py` are imported
by code that never runs an engine (the driver, the team shapes), which must not pay for torch
and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_core.inference.api import FinishReason, Generation, InferenceBackend
from flexmarl_core.runtime.startup import lazy_names

if TYPE_CHECKING:
    from flexmarl_core.inference.factory import make_inference_engine
    from flexmarl_core.inference.hf import HFInferenceEngine

__getattr__ = lazy_names(__name__, {"make_inference_engine": "factory", "HFInferenceEngine": "hf"})

__all__ = [
    "FinishReason",
    "Generation",
    "HFInferenceEngine",
    "InferenceBackend",
    "make_inference_engine",
]
