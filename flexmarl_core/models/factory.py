"""Model factory: tiny Qwen2-style causal LMs built locally, or any local HF model folder.

    tok = get_tokenizer()
    model = build_model(ModelConfig(preset="tiny-1m"), seed=0, tokenizer=tok)
    model, tok = load_agent_model(agent.model, seed=cfg.seed)   # cached base model
    save_model(model, tok, "runs/x/ckpt/solver")

Presets are random-initialised (deterministic in `seed`); a run SFTs them first (`flexmarl sft`).
Models come back in fp32 (trainer master weights); `ModelConfig.dtype` is applied by the
inference engine factory, which owns its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

from flexmarl_core.config import ModelConfig
from flexmarl_core.models.tokenizer import (
    default_cache_dir,
    get_tokenizer,
    load_tokenizer,
    tokenizer_key,
)
from storage.atomic import atomic_folder

# Per-load "Loading weights" / "Writing model shards" bars: workers load models every time an
# instance moves, and dozens of bars would drown the run's own progress display.
hf_logging.disable_progress_bar()


@dataclass(frozen=True)
class Preset:
    """Shape of a built-in Qwen2 model. `vocab_size` None: the tokenizer's 1024 tokens (parameter
    counts below); else the embedding has that many rows, of which the tokenizer uses the first
    1024 (as a real checkpoint pads its embedding past its tokenizer)."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    vocab_size: int | None = None


PRESETS: dict[str, Preset] = {
    "tiny-1m": Preset(128, 4, 512, 4, 2),  # 1.1M params
    "tiny-10m": Preset(256, 10, 1024, 4, 2),  # 10.1M
    "tiny-50m": Preset(512, 12, 2048, 8, 4),  # 47.7M
    # Qwen2.5-0.5B's shape: 494M parameters (136M of them the tied embedding of its 151,936-row
    # vocabulary), random weights; what real-size memory, speed and swap costs are measured on.
    "small-0.5b": Preset(896, 24, 4864, 14, 2, max_position_embeddings=32768, vocab_size=151_936),
}


def _preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r} (model.preset); valid presets: {sorted(PRESETS)}, "
            "or set model.path to a local Hugging Face model folder"
        ) from None


def preset_config(name: str, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    p = _preset(name)
    shape = asdict(p)
    vocab = shape.pop("vocab_size") or len(tokenizer)
    return Qwen2Config(
        vocab_size=max(vocab, len(tokenizer)),
        **shape,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(cfg: ModelConfig, *, seed: int, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialised preset model in fp32; identical weights for the same (preset, seed).

    The global torch RNG is left untouched (the init runs in a forked RNG).
    """
    if cfg.preset is None:
        raise ValueError("build_model needs model.preset; use load_agent_model for model.path")
    config = preset_config(cfg.preset, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.float().eval()


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str]
) -> Path:
    """Save weights (safetensors), config and tokenizer in HF format; `load_model` reads it back."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def load_model(
    path: str | os.PathLike[str], *, tokenizer: PreTrainedTokenizerBase | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local HF folder as (fp32 model in eval mode, tokenizer)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(
            f"model.path {str(path)!r} is not a Hugging Face model folder (no config.json); "
            "point it at a folder written by save_pretrained / save_model"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    return model.eval(), tokenizer


def base_model_dir(preset: str, seed: int, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    # The folder name pins everything the weights depend on, so a changed preset or tokenizer
    # recipe never silently reuses a stale cache.
    shape = hashlib.sha256(json.dumps(asdict(_preset(preset)), sort_keys=True).encode()).hexdigest()[:8]
    return default_cache_dir(cache_dir) / "models" / f"{preset}-{shape}-seed{seed}-{tokenizer_key()}"


def load_agent_model(
    cfg: ModelConfig, *, seed: int, cache_dir: str | os.PathLike[str] | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(fp32 model, tokenizer) for an agent: its folder (`cfg.path`, or its hub id resolved in this
    machine's cache) if set, else the cached preset model.

    The preset model is built on first use and saved under `cache_dir` (temp folder + rename),
    so parallel workers load one identical copy instead of each rebuilding it.
    """
    folder = cfg.folder()
    if folder is not None:
        return load_model(folder)
    if cfg.preset is None:  # ModelConfig's validator already forbids this; keeps mypy honest
        raise ValueError("set model.preset (e.g. tiny-1m) or model.path")
    path = base_model_dir(cfg.preset, seed, cache_dir)
    if not (path / "model.safetensors").exists():
        tok = get_tokenizer(cache_dir)
        model = build_model(cfg, seed=seed, tokenizer=tok)
        with atomic_folder(path) as tmp:  # parallel workers never see half a folder
            save_model(model, tok, tmp)
    return load_model(path)


def num_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
