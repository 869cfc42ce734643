"""Location-agnostic handles for trainer states (on-demand allocation swaps states in and out).

    h = put(trainer.state(), "memory")          # host memory (tensors cloned to CPU)
    h = put(trainer.state(), "disk")            # a file under $FLEXMARL_CACHE/states
    h = put(trainer.state(), "s3://bucket/x")   # any pyarrow.fs URI or a local path
    trainer.load_state(get(h, device="cpu"))    # bit-exact, wherever it was
    drop(h)

A state is a nested dict/list of tensors and plain Python values (what `TrainBackend.state()`
returns). Files are written with `torch.save` (temp name + rename on local disk) and read with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from flexmarl_core.models.tokenizer import default_cache_dir
from flexmarl_core.training.torch_trainer import clone_tree

Location = Literal["memory", "disk"]

_MEMORY: dict[str, Any] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class StateHandle:
    """Where a state lives: `kind` "memory" (key in this process) or "file" (path or URI)."""

    kind: Literal["memory", "file"]
    key: str  #: memory key, local path or pyarrow.fs URI
    nbytes: int  #: tensor bytes in the state (for placement decisions)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0


def _to_device(obj: Any, device: torch.device | str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _is_uri(where: str) -> bool:
    return "://" in where and not where.startswith("file://")


def put(
    state: dict[str, Any],
    where: Location | str = "memory",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> StateHandle:
    """Store a copy of `state` and return its handle.

    Args:
        where: "memory" (this process, CPU tensors), "disk" (a new file under
            `cache_dir`/states, default `$FLEXMARL_CACHE`), a local file path, `file://path`,
            or a URI pyarrow.fs understands (s3://, gs://, hdfs://).
    """
    nbytes = _nbytes(state)
    if where == "memory":
        key = uuid.uuid4().hex
        copy = _to_device(clone_tree(state), "cpu")
        with _LOCK:
            _MEMORY[key] = copy
        return StateHandle("memory", key, nbytes)
    if where == "disk":
        target = default_cache_dir(cache_dir) / "states" / f"{uuid.uuid4().hex}.pt"
    elif _is_uri(where):
        import pyarrow.fs as pafs  # only needed for remote stores

        buf = io.BytesIO()
        torch.save(state, buf)
        fs, path = pafs.FileSystem.from_uri(where)
        with fs.open_output_stream(path) as f:
            f.write(buf.getvalue())
        return StateHandle("file", where, nbytes)
    else:
        target = Path(where.removeprefix("file://"))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, target)  # readers never see half a file
    return StateHandle("file", str(target), nbytes)


def get(handle: StateHandle, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The state behind `handle`, tensors on `device` (a fresh copy; the handle stays valid)."""
    if handle.kind == "memory":
        with _LOCK:
            if handle.key not in _MEMORY:
                raise ValueError(
                    f"no in-memory state {handle.key!r} in this process (dropped, or put() ran in "
                    "another process: use where='disk' or a URI to move states between workers)"
                )
            state = _MEMORY[handle.key]
        return _to_device(clone_tree(state), device)
    if _is_uri(handle.key):
        import pyarrow.fs as pafs

        fs, path = pafs.FileSystem.from_uri(handle.key)
        with fs.open_input_stream(path) as f:
            data = io.BytesIO(f.read())
        return torch.load(data, map_location=device, weights_only=True)
    return torch.load(handle.key, map_location=device, weights_only=True)


def drop(handle: StateHandle) -> None:
    """Free the memory or delete the file behind `handle` (missing is fine)."""
    if handle.kind == "memory":
        with _LOCK:
            _MEMORY.pop(handle.key, None)
    elif _is_uri(handle.key):
        import pyarrow.fs as pafs

        fs, path = pafs.FileSystem.from_uri(handle.key)
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            pass
    else:
        Path(handle.key).unlink(missing_ok=True)
