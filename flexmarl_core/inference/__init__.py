"""Inference engine: batched sampling with exact per-token logprobs and weight updates."""

from flexmarl_core.inference.api import FinishReason, Generation, InferenceBackend
from flexmarl_core.inference.factory import make_inference_engine
from flexmarl_core.inference.hf import HFInferenceEngine

__all__ = [
    "FinishReason",
    "Generation",
    "HFInferenceEngine",
    "InferenceBackend",
    "make_inference_engine",
]
