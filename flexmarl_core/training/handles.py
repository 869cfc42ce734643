"""Location-agnostic handles for trainer states (on-demand allocation swaps states in and out).

    h = put(trainer.state(), "memory")          # host memory of this process
    h = put(trainer.state(), "disk")            # a file under $FLEXMARL_CACHE/states
    h = put(trainer.state(), "s3://bucket/x")   # any pyarrow.fs URI or a local path
    trainer.load_state(get(h, device="cpu"))    # bit-exact, wherever it was
    drop(h)

A state is a nested dict/list/tuple of tensors and plain Python values (int, float, bool, str,
bytes, None), which is what `TrainBackend.state()` returns.

Swapping is meant to run at memory-copy speed (bench/swap.py measures it against a plain memcpy):

* The memory tier packs all tensors of a state into ONE flat byte buffer with one `torch.cat`,
  and `get` is one flat `copy_` plus cheap views, whatever the number of tensors; both copy
  with torch's intra-op threads. Tensors are ordered by element size (largest first) so every slot is aligned for its
  dtype without padding.
* Flat buffers come from a small process-wide pool and go back to it when their last user lets
  go (a dropped handle, or a state returned by `get` once the caller has loaded it). On a VM,
  writing fresh pages costs several times a memcpy (page faults); a reused buffer is already
  mapped.
* Nothing is pickled. Files hold a short JSON header (magic, slot table, skeleton) and then
  the raw tensor bytes, written straight from the tensors (no staging copy) and read back with
  `readinto` into a pooled buffer. A file is plain data: reading one runs no code from it,
  whoever wrote it (run folders on shared object storage), and a malformed one raises
  `StateFileError` naming it. Files are not fsynced: a swapped state lives as long as the run
  that wrote it.

What a round trip keeps: dtype, shape and every byte of each tensor, and which entries were the
same tensor object (tied embeddings come back tied). What it does not keep: strides (tensors come
back contiguous), views between different tensors, or dict subclasses (they come back as dict).
Tensors returned by `get` on the CPU each own their bytes of a pooled buffer (torch.save of one
writes only its bytes) but cannot be resized in place (`resize_`); the buffer returns to the pool
when the last of them is freed.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import struct
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import torch

from flexmarl_core.runfiles.location import default_cache_dir
from flexmarl_core.runfiles.location import is_uri as _is_uri
from storage.atomic import atomic_file
from storage.fs import open_filesystem  # the store's resolution of a URI: AWS_ENDPOINT_URL and all

Location = Literal["memory", "disk"]

_MAGIC = b"FLXSTATE\x02\n"  # 10 bytes; torch.save files start with "PK" (zip)
_OLD_MAGIC = b"FLXSTATE\x01\n"  # the format whose header was a pickle: refused
_ALIGN = 64  # raw tensor bytes start at a multiple of this in a file
_SCALARS = (int, float, bool, str, bytes, complex, type(None))

_LOCK = threading.Lock()

# dtypes numpy has: their tensors convert with one torch call (per-tensor overhead is most of a
# small state's swap time). Others (bfloat16, float8) go through a torch uint8 view.
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    t: np.dtype(n)
    for t, n in [
        (torch.float32, "float32"), (torch.float64, "float64"), (torch.float16, "float16"),
        (torch.int64, "int64"), (torch.int32, "int32"), (torch.int16, "int16"),
        (torch.int8, "int8"), (torch.uint8, "uint8"), (torch.bool, "bool"),
        (torch.complex64, "complex64"), (torch.complex128, "complex128"),
    ]
}


@dataclass(frozen=True, slots=True)
class StateHandle:
    """Where a state lives: `kind` "memory" (key in this process) or "file" (path or URI)."""

    kind: Literal["memory", "file"]
    key: str  #: memory key, local path or pyarrow.fs URI
    nbytes: int  #: tensor bytes in the state (for placement decisions)


# -- buffer pool -------------------------------------------------------------------------------
class _BufferPool:
    """Reusable flat host buffers (numpy-owned, so their users can be counted).

    A tensor made by `torch.from_numpy` holds a reference to its array (and a numpy slice to its
    base) for as long as the tensor or a view of it lives, so a base array whose only reference
    is our list is free to hand out again. At most `max_spare` free buffers are kept.
    """

    def __init__(self, max_spare: int = 2) -> None:
        self.max_spare = max_spare
        self._bufs: list[np.ndarray] = []

    def _free(self) -> list[int]:
        # Indexing (no loop variable) leaves two references: our list and getrefcount's argument.
        return [i for i in range(len(self._bufs)) if sys.getrefcount(self._bufs[i]) <= 2]

    def take(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of `nbytes` (a slice of a reused buffer when one fits)."""
        with _LOCK:
            # At most 2x the request: a small state must not pin a big buffer.
            fits = [i for i in self._free() if nbytes <= self._bufs[i].nbytes <= 2 * nbytes + 4096]
            if fits:
                base = self._bufs[min(fits, key=lambda i: self._bufs[i].nbytes)]
            else:
                base = np.empty(max(nbytes, 1), dtype=np.uint8)
                self._bufs.append(base)
            out = base[:nbytes]
            del base
            spare = self._free()
            for i in reversed(spare[: max(0, len(spare) - self.max_spare)]):  # oldest go first
                del self._bufs[i]
        return out

    def trim(self) -> None:
        with _LOCK:
            for i in reversed(self._free()):
                del self._bufs[i]


_POOL = _BufferPool()


def trim_buffers() -> None:
    """Give the spare swap buffers of this process back to the allocator (under memory pressure)."""
    _POOL.trim()


# -- packing -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Slot:
    """One tensor's place in a flat buffer."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Ref:
    """Stands for tensor number `index` in a skeleton."""

    index: int


@dataclass(frozen=True, slots=True)
class _Flat:
    """A state as a skeleton, a slot table, and its tensor bytes in buffer order."""

    skeleton: Any  #: the state with every tensor replaced by a _Ref
    slots: list[_Slot]
    parts: list[Any]  #: flat uint8 tensors (or one packed numpy buffer); concatenated, the bytes
    nbytes: int  #: sum of slot sizes


def _skeleton(obj: Any, tensors: list[torch.Tensor], seen: dict[int, int], path: str) -> Any:
    """`obj` with tensors replaced by _Ref (one per distinct tensor object), collecting them."""
    if isinstance(obj, torch.Tensor):
        index = seen.get(id(obj))
        if index is None:
            index = seen[id(obj)] = len(tensors)
            tensors.append(obj)
        return _Ref(index)
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors, seen, f"{path}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_skeleton(v, tensors, seen, f"{path}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, _SCALARS):
        return obj
    raise TypeError(
        f"state{path} is a {type(obj).__name__}; a trainer state may hold only tensors, "
        "dict/list/tuple and int/float/bool/str/bytes/None (convert it, e.g. to a tensor or str)"
    )


def _layout(tensors: list[torch.Tensor]) -> tuple[list[_Slot], int]:
    """Slots ordered by element size, largest first, so each offset suits its dtype."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    slots: list[_Slot | None] = [None] * len(tensors)
    offset = 0
    for i in order:
        t = tensors[i]
        slots[i] = _Slot(t.dtype, tuple(t.shape), offset, t.nbytes)
        offset += t.nbytes
    return slots, offset  # type: ignore[return-value]


def _flatten(state: Any) -> _Flat:
    """`state` as a _Flat whose parts are byte views of its own tensors (no copy yet)."""
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(state, tensors, {}, "")
    slots, total = _layout(tensors)
    order = sorted(range(len(tensors)), key=lambda i: slots[i].offset)
    return _Flat(skeleton, slots, [_bytes_of(tensors[i]) for i in order], total)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its own device (a view unless non-contiguous).

    A GPU tensor stays on the GPU: `_pack` copies it straight into the pooled host buffer. A
    `.cpu()` here cost a second copy through fresh pageable pages (a swap-out at a tenth of the
    device-to-host copy speed on an H200).
    """
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _pack(flat: _Flat) -> _Flat:
    """`flat` copied into one pooled buffer by a single `torch.cat`.

    One op for the whole state: it copies with torch's intra-op threads, as fast as a
    multi-threaded memcpy, and opens one thread-pool region. Per-tensor copies (hundreds of
    ~1 MB `copy_` calls, each its own region) ran at a fifth of memcpy speed on a loaded box.
    """
    data = _POOL.take(flat.nbytes)
    dst = torch.from_numpy(data)
    if flat.parts and all(p.device.type == "cpu" for p in flat.parts):
        torch.cat(flat.parts, out=dst)
    else:  # GPU tensors: one device-to-host copy each, straight into its place in the buffer
        offset = 0
        for part in flat.parts:
            dst[offset : offset + part.numel()].copy_(part)
            offset += part.numel()
    return _Flat(flat.skeleton, flat.slots, [data], flat.nbytes)


def _views(data: np.ndarray, slots: list[_Slot], device: torch.device | str) -> list[torch.Tensor]:
    """One tensor per slot, each on its own storage over its bytes of `data`.

    Own storage, not a slice of one big tensor: torch.save of one tensor then writes only its
    bytes, and torch.set_rng_state reads a state at a storage offset wrongly (segfault, torch
    2.13).
    """
    out = [
        torch.from_numpy(data[s.offset : s.offset + s.nbytes].view(_NUMPY_DTYPES[s.dtype]).reshape(s.shape))
        if s.dtype in _NUMPY_DTYPES
        else torch.from_numpy(data[s.offset : s.offset + s.nbytes]).view(s.dtype).view(s.shape)
        for s in slots
    ]
    if torch.device(device).type != "cpu":
        out = [t.to(device) for t in out]
    return out


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, tensors) for v in obj)
    return obj


# -- file format -------------------------------------------------------------------------------
# A state file is plain data: the magic, the header's length (u64 little-endian), a UTF-8 JSON
# header, zero padding to _ALIGN, then the raw tensor bytes. Reading one never imports or calls
# anything named in the file (no pickle): the header's dtypes come from a fixed table and its
# skeleton is decoded by `_decode`, which knows only containers, scalars and tensor slots.
# Skeleton encoding: str/int/float/bool/None are JSON values as they are; every JSON object is
# a one-key tag: {"dict": [[k, v], ...]} (keys of any type, order kept), {"list": [...]},
# {"tuple": [...]}, {"tensor": i}, {"bytes": "<base64>"}, {"complex": [re, im]}.

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in [
        *_NUMPY_DTYPES, torch.bfloat16, torch.uint16, torch.uint32, torch.uint64,
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    ]
}
_MAX_HEADER = 256 << 20  # a header past this is not one flexmarl wrote (states are six tensors)


class StateFileError(ValueError):
    """A file that is not a well-formed flexmarl trainer state; the message names the file."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, _Ref):
        return {"tensor": obj.index}
    if isinstance(obj, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"list": [_encode(v) for v in obj]}
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v) for v in obj]}
    if isinstance(obj, bytes):
        return {"bytes": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, complex):
        return {"complex": [obj.real, obj.imag]}
    return obj  # str, int, float, bool, None: JSON keeps each one's type


def _decode(obj: Any, tensors: list[torch.Tensor], what: str) -> Any:
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise StateFileError(f"state file {what}: unexpected {type(obj).__name__} in its skeleton")
    (tag, val), = obj.items()
    try:
        if tag == "tensor":
            if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < len(tensors):
                raise StateFileError(f"state file {what}: tensor slot {val!r} out of range")
            return tensors[val]
        if tag == "dict":
            return {_key(_decode(k, tensors, what), what): _decode(v, tensors, what) for k, v in val}
        if tag == "list":
            return [_decode(v, tensors, what) for v in val]
        if tag == "tuple":
            return tuple(_decode(v, tensors, what) for v in val)
        if tag == "bytes":
            return base64.b64decode(val, validate=True)
        if tag == "complex":
            re_, im = val
            return complex(float(re_), float(im))
    except (TypeError, ValueError, binascii.Error) as e:
        if isinstance(e, StateFileError):
            raise
        raise StateFileError(f"state file {what}: malformed {tag!r} entry in its skeleton ({e})") from None
    raise StateFileError(f"state file {what}: unknown skeleton tag {tag!r}")


def _key(k: Any, what: str) -> Any:
    if isinstance(k, list | dict):  # unhashable: never written by `_encode` of a real state
        raise StateFileError(f"state file {what}: a dict key is a {type(k).__name__}")
    return k


def _header(flat: _Flat) -> bytes:
    """Magic, header length, JSON header, padded to _ALIGN."""
    table = [[str(s.dtype).removeprefix("torch."), list(s.shape), s.offset, s.nbytes] for s in flat.slots]
    body = json.dumps({"slots": table, "nbytes": flat.nbytes, "skeleton": _encode(flat.skeleton)},
                      separators=(",", ":")).encode("utf-8")
    head = _MAGIC + struct.pack("<Q", len(body)) + body
    return head + b"\0" * (-len(head) % _ALIGN)


def _write(f: BinaryIO, flat: _Flat) -> None:
    """Header, then each tensor's bytes straight from the tensor (one copy, into the file)."""
    f.write(_header(flat))
    for part in flat.parts:
        if isinstance(part, torch.Tensor):
            part = part.cpu().numpy()  # a no-op for a CPU tensor
        f.write(memoryview(part))


def _read_exact(f: Any, out: memoryview, what: str) -> None:
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:
            raise StateFileError(f"state file {what} is truncated: {got} of {len(out)} data bytes")
        got += n


def _slots(header: dict[str, Any], what: str) -> tuple[list[_Slot], int]:
    """The slot table, checked: known dtypes, sizes that match the shapes, inside the data."""
    data_len = header.get("nbytes")
    if not isinstance(data_len, int) or data_len < 0:
        raise StateFileError(f"state file {what}: header field 'nbytes' is {data_len!r}")
    slots = []
    for i, row in enumerate(header.get("slots") or []):
        try:
            name, shape, offset, nbytes = row
            dtype = _DTYPES[name]
            shape = tuple(int(d) for d in shape)
        except (KeyError, TypeError, ValueError):
            raise StateFileError(
                f"state file {what}: slot {i} is {row!r}; expected [dtype, shape, offset, nbytes] "
                f"with dtype one of {sorted(_DTYPES)}") from None
        count = 1
        for d in shape:
            count *= d
        if (min(shape, default=0) < 0 or not isinstance(offset, int) or offset < 0
                or nbytes != count * dtype.itemsize or offset + nbytes > data_len):
            raise StateFileError(f"state file {what}: slot {i} ({row!r}) does not fit its "
                                 f"shape or the {data_len} data bytes")
        slots.append(_Slot(dtype, shape, offset, nbytes))
    return slots, data_len


def _load(f: Any, device: torch.device | str, what: str) -> dict[str, Any]:
    """Read a state file from `f` (at its start): plain data only, checked before use."""
    magic = f.read(len(_MAGIC))
    if magic != _MAGIC:
        why = (" (an older flexmarl format whose header was a pickle: it is not read, since "
               "unpickling can run code; re-create the state)" if magic == _OLD_MAGIC else "")
        raise StateFileError(f"{what} is not a flexmarl trainer state file (no {_MAGIC!r} header){why}")
    fixed = f.read(8)
    if len(fixed) != 8:
        raise StateFileError(f"state file {what} is truncated in its header")
    (body_len,) = struct.unpack("<Q", fixed)
    if body_len > _MAX_HEADER:
        raise StateFileError(f"state file {what}: header of {body_len} bytes is not plausible")
    body = f.read(body_len)
    if len(body) != body_len:
        raise StateFileError(f"state file {what} is truncated in its header")
    try:
        header = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFileError(f"state file {what}: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise StateFileError(f"state file {what}: its header is not a JSON object")
    slots, data_len = _slots(header, what)
    f.read(-(len(_MAGIC) + 8 + body_len) % _ALIGN)  # padding
    data = _POOL.take(data_len)
    _read_exact(f, memoryview(data), what)
    tensors = _views(data, slots, device)
    return _decode(header.get("skeleton"), tensors, what)


def dump(state: dict[str, Any], f: BinaryIO) -> int:
    """Write `state` to the binary file `f` in the state file format; its tensor bytes."""
    flat = _flatten(state)
    _write(f, flat)
    return flat.nbytes


def load(f: Any, device: torch.device | str = "cpu", what: str = "state") -> dict[str, Any]:
    """A state read from `f` (from its start), tensors on `device`.

    Raises:
        StateFileError: `f` is not a state file this module wrote (named by `what`).
    """
    return _load(f, device, what)


def _open_uri(uri: str) -> tuple[Any, str]:
    fs, path, _ = open_filesystem(uri)
    return fs, path


# -- API ---------------------------------------------------------------------------------------
_MEMORY: dict[str, _Flat] = {}


def put(
    state: dict[str, Any],
    where: Location | str = "memory",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> StateHandle:
    """Store a copy of `state` and return its handle.

    Args:
        where: "memory" (this process, CPU), "disk" (a new file under `cache_dir`/states,
            default `$FLEXMARL_CACHE`), a local file path, `file://path`, or a URI pyarrow.fs
            understands (s3://, gs://, hdfs://).

    Raises:
        TypeError: a leaf of `state` is neither a tensor nor a builtin scalar.
    """
    flat = _flatten(state)
    nbytes = flat.nbytes
    if where == "memory":
        key = uuid.uuid4().hex
        packed = _pack(flat)
        with _LOCK:
            _MEMORY[key] = packed
        return StateHandle("memory", key, nbytes)
    if where == "disk":
        target = default_cache_dir(cache_dir) / "states" / f"{uuid.uuid4().hex}.state"
    elif _is_uri(where):
        fs, path = _open_uri(where)
        with fs.open_output_stream(path) as f:
            _write(f, flat)
        return StateHandle("file", where, nbytes)
    else:
        target = Path(where.removeprefix("file://"))
    with atomic_file(target) as f:  # readers never see half a file
        _write(f, flat)
    return StateHandle("file", str(target), nbytes)


def get(handle: StateHandle, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The state behind `handle`, tensors on `device` (a fresh copy; the handle stays valid).

    Raises:
        ValueError: a memory handle that was dropped or belongs to another process.
        FileNotFoundError: the handle's file is gone (the message names it).
    """
    if handle.kind == "memory":
        with _LOCK:
            packed = _MEMORY.get(handle.key)
        if packed is None:
            raise ValueError(
                f"no in-memory state {handle.key!r} in this process (dropped, or put() ran in "
                "another process: use where='disk' or a URI to move states between workers)"
            )
        data = _POOL.take(packed.nbytes)
        # One multi-threaded copy (torch intra-op threads); np.copyto is a 1-thread memcpy.
        torch.from_numpy(data).copy_(torch.from_numpy(packed.parts[0]))
        return _rebuild(packed.skeleton, _views(data, packed.slots, device))
    if _is_uri(handle.key):
        fs, path = _open_uri(handle.key)
        try:
            f = fs.open_input_file(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"state {handle.key} is missing (dropped?): {e}") from e
        with f:
            return _load(f, device, handle.key)
    try:
        f = open(handle.key, "rb", buffering=0)  # readinto goes straight to the buffer
    except FileNotFoundError as e:
        raise FileNotFoundError(f"state file {handle.key} is missing (dropped?)") from e
    with f:
        return _load(f, device, handle.key)


def drop(handle: StateHandle) -> None:
    """Free the memory or delete the file behind `handle` (missing is fine)."""
    if handle.kind == "memory":
        with _LOCK:
            _MEMORY.pop(handle.key, None)
    elif _is_uri(handle.key):
        fs, path = _open_uri(handle.key)
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            pass
    else:
        Path(handle.key).unlink(missing_ok=True)
