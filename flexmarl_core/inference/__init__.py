"""Inference engine: batched sampling with exact per-token logprobs and weight updates.

The engines (`factory.py`, `hf.py`) load on first use: the contracts in `api.py` are imported
by code that never runs an engine (the driver, the team shapes), which must not pay for torch
and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flexmarl_core.inference.api import FinishReason, Generation, InferenceBackend

if TYPE_CHECKING:
    from flexmarl_core.inference.factory import make_inference_engine
    from flexmarl_core.inference.hf import HFInferenceEngine

_HOME = {"make_inference_engine": "factory", "HFInferenceEngine": "hf"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "FinishReason",
    "Generation",
    "HFInferenceEngine",
    "InferenceBackend",
    "make_inference_engine",
]
