"""The weight files of a run and of a saved team: their format and how they are written and read.

Weights move between processes as versioned safetensors files at the run's location
(`location.weights_key`): the trainer's sync publishes each version (atomically: a retry
rewrites the same bytes), a rollout engine anywhere loads it. LoRA agents' shared base is
published once per run (`location.base_weights_key`), a gradient helper's gradient of one
micro-batch until its agent's step adds it (`location.gradient_key`). A saved team (`flexmarl
sft`, a warm start, `train.init_from`) is a folder of `<agent>/model.safetensors`.

safetensors is plain data (a JSON header and raw bytes, never code), so a file from another
machine is safe to read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_safetensors

from flexmarl_core.runfiles.location import (
    RunLocation,
    as_location,
    base_weights_key,
    gradient_key,
    trainer_key,
    weights_key,
)
from storage.atomic import atomic_path

#: A run folder: a local path, a URI, or an opened location.
RunDir = str | os.PathLike[str] | RunLocation
#: A model's state dict.
State = dict[str, torch.Tensor]

__all__ = [
    "RunDir", "from_safetensors", "initial_weights", "load_base", "load_gradient", "load_weights",
    "publish_base", "publish_gradient", "publish_weights", "save_state_atomic", "trainer_state_path",
    "weights_path",
]


def weights_path(run_dir: str | Path, agent: str, version: int) -> Path:
    """A weights version's file in a run folder on local disk (`location.weights_key` in any)."""
    return Path(run_dir) / weights_key(agent, version)


def trainer_state_path(run_dir: str | Path, agent: str, version: int) -> Path:
    """A trainer state's file in a run folder on local disk (`location.trainer_key` in any)."""
    return Path(run_dir) / trainer_key(agent, version)


def _unshared(state: State) -> State:
    """`state` on the CPU as safetensors writes it: no two tensors on one storage. A trainer's
    parameters are views of one flat buffer (`TorchTrainer`): each becomes a tensor of its own
    storage over the same memory (no copy); only tensors over the same bytes (tied embeddings:
    lm_head must travel with the rest, or a vLLM push silently keeps the old output layer) are
    copied."""
    out: State = {}
    seen: set[tuple[int, int]] = set()
    for k, v in state.items():
        t = v.detach().to("cpu").contiguous()
        span = (t.data_ptr(), t.numel() * t.element_size())
        if span in seen or t.numel() == 0:
            out[k] = t.clone()
            continue
        seen.add(span)
        flat = torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy())  # own storage, same bytes
        out[k] = flat.view(t.dtype).reshape(t.shape)
    return out


def from_safetensors(blob: bytes, what: str) -> State:
    """Tensors from safetensors bytes; `what` names them in the error of a malformed file."""
    try:
        return load_safetensors(blob)
    except Exception as e:  # safetensors raises its own error type for every malformed file
        raise ValueError(f"{what} is not a safetensors weights file ({type(e).__name__}: {e})") from None


def save_state_atomic(path: Path, state: State) -> Path:
    """Write a state dict as safetensors atomically (temp + rename): readers never see half."""
    with atomic_path(path) as tmp:
        save_file(_unshared(state), str(tmp))
    return path


def publish_weights(run_dir: RunDir, agent: str, version: int, state: State) -> bytes | None:
    """Publish one weights version (a retry rewrites the same bytes). On an object store its
    safetensors bytes are made in memory for the one PUT, and returned (a sync pushes them on);
    on local disk the tensors are written straight into the file (temp + rename), with no copy
    of the weights in memory (a 0.5B model's sync would otherwise hold three), and None."""
    loc = as_location(run_dir)
    if not loc.local:
        blob = save_safetensors(_unshared(state))
        loc.write_bytes(weights_key(agent, version), blob)
        return blob
    path = Path(loc.path(weights_key(agent, version)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(_unshared(state), str(tmp))
    return None


def load_weights(run_dir: RunDir, agent: str, version: int) -> State:
    loc = as_location(run_dir)
    try:
        blob = loc.read_bytes(weights_key(agent, version))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"agent {agent!r}: weights version {version} not published at "
            f"{loc.display(weights_key(agent, version))}") from None
    return from_safetensors(blob, loc.display(weights_key(agent, version)))


def publish_base(run_dir: RunDir, key: str, state: State) -> None:
    """Publish the shared base `key` of LoRA agents (`models.lora.base_key`)."""
    as_location(run_dir).write_bytes(base_weights_key(key), save_safetensors(_unshared(state)))


def load_base(run_dir: RunDir, key: str) -> State:
    loc = as_location(run_dir)
    return from_safetensors(loc.read_bytes(base_weights_key(key)), loc.display(base_weights_key(key)))


def publish_gradient(loc: RunLocation, agent: str, iteration: int, mb: int, grad: torch.Tensor) -> None:
    """A gradient helper's flat gradient of one micro-batch, for the agent's step to add."""
    loc.write_bytes(gradient_key(agent, iteration, mb), save_safetensors({"grad": grad}))


def load_gradient(loc: RunLocation, agent: str, iteration: int, mb: int) -> torch.Tensor | None:
    """The gradient a helper published for (`iteration`, `mb`), or None if there is none."""
    key = gradient_key(agent, iteration, mb)
    if not loc.is_file(key):
        return None
    return from_safetensors(loc.read_bytes(key), loc.display(key))["grad"]


def initial_weights(init_from: str | os.PathLike[str] | None, agent: str) -> State | None:
    """Weights from `init_from/<agent>` (`train.init_from`, the warm start, or a team
    `flexmarl sft` saved), if any."""
    if not init_from:
        return None
    path = Path(init_from) / agent / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint for agent {agent!r} at {path}")
    return load_file(str(path))
