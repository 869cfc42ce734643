"""Models: tiny Qwen2-style presets with a locally trained tokenizer, or local HF folders."""

from flexmarl_core.models.factory import (
    PRESETS,
    Preset,
    base_model_dir,
    build_model,
    load_agent_model,
    load_model,
    num_params,
    preset_config,
    save_model,
)
from flexmarl_core.models.logprobs import scoring_temperature, token_logprobs
from flexmarl_core.models.tokenizer import (
    CHAT_TEMPLATE,
    default_cache_dir,
    get_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "Preset",
    "base_model_dir",
    "build_model",
    "default_cache_dir",
    "get_tokenizer",
    "load_agent_model",
    "load_model",
    "load_tokenizer",
    "num_params",
    "preset_config",
    "save_model",
    "scoring_temperature",
    "token_logprobs",
    "train_tokenizer",
]
