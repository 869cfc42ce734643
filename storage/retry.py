"""Retries for object stores: every call of a remote filesystem (the MEG Store's and the run
location's) is retried on a transient failure (a 503, a dropped or reset connection, a
timeout), with exponential backoff and full jitter, up to the limits `configure` sets
(`store.retries` in a run's config).

The wrapper is a `pyarrow.fs.PyFileSystem` around the real one, so every caller keeps its
`pyarrow.fs` calls. Two things change for remote files: a write is buffered and sent as one PUT
when the file is closed, and a read is one GET of the whole object. So a retry sends or fetches
the whole object again, never a tail, and nothing half-written is ever visible: an object store
publishes a PUT whole or not at all. Local disks are never wrapped.

A permanent failure (a missing object, refused credentials, no such bucket) is raised at once
as the filesystem raised it; a transient one past the limits raises `StoreIOError`, one line
naming the operation, the key and the last error.
"""

from __future__ import annotations

import io
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["RetryPolicy", "RetryingHandler", "StoreIOError", "configure", "policy", "retried", "transient"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` tries in all; before try k+1 a sleep drawn from [0, min(max_delay_s,
    base_delay_s * 2**k)] (full jitter: many workers retrying at once spread out)."""

    attempts: int = 6
    base_delay_s: float = 0.2
    max_delay_s: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError(f"bad retry policy {self}: attempts >= 1, 0 <= base_delay_s <= max_delay_s")

    def delay(self, k: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * 2**k))


_policy = RetryPolicy()
_rng = random.Random()
#: transient failures retried in this process so far (what ops report as `store/retries`)
_retried = 0


def retried() -> int:
    """How many transient failures this process has retried so far."""
    return _retried


def configure(new: RetryPolicy) -> None:
    """The limits every remote filesystem of this process uses from now on (each call reads
    them, so filesystems opened earlier follow too)."""
    global _policy
    _policy = new


def policy() -> RetryPolicy:
    return _policy


class StoreIOError(OSError):
    """An object-store operation that failed transiently on every try."""


#: words of errors that another try cannot fix (pyarrow's AWS error names and HTTP statuses)
_PERMANENT = ("ACCESS_DENIED", "NO_SUCH_BUCKET", "NoSuchBucket", "InvalidAccessKeyId",
              "SignatureDoesNotMatch", "INVALID_ACCESS_KEY", "HTTP status 403", "HTTP status 400",
              "Unrecognized filesystem", "not a directory", "is a directory")


def transient(exc: BaseException) -> bool:
    """Whether another try may succeed: an OSError that is not a missing file, a refused
    permission or a configuration error."""
    if not isinstance(exc, OSError) or isinstance(exc, (FileNotFoundError, PermissionError,
                                                        IsADirectoryError, NotADirectoryError)):
        return False
    text = str(exc)
    return not any(word in text for word in _PERMANENT)


def call(operation: str, where: str, fn: Callable[[], T]) -> T:
    """`fn()`, retried per the policy while it fails transiently."""
    p = _policy
    for k in range(p.attempts):
        try:
            return fn()
        except OSError as exc:
            if not transient(exc):
                raise
            if k + 1 == p.attempts:
                text = " ".join(str(exc).split())[:300]
                raise StoreIOError(f"{where}: {operation} failed {p.attempts} times (store.retries."
                                   f"attempts): {text}") from exc
            global _retried
            _retried += 1  # a plain int under the GIL: a lost increment miscounts, never breaks
            time.sleep(p.delay(k, _rng))
    raise AssertionError("unreachable")


class _PutOnClose(io.RawIOBase):
    """A write buffered in memory and sent as one PUT (retried whole) when closed."""

    def __init__(self, handler: RetryingHandler, path: str, metadata: Any) -> None:
        self.handler, self.path, self.metadata = handler, path, metadata
        self.buf = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.buf.write(b)

    def close(self) -> None:
        if self.closed:
            return
        data = self.buf.getvalue()
        super().close()  # closed either way: a failed PUT is not retried by a second close
        self.buf = io.BytesIO()
        fs, path, metadata = self.handler.fs, self.path, self.metadata

        def put() -> None:
            with fs.open_output_stream(path, metadata=metadata) as out:
                out.write(data)

        self.handler.call("PUT", path, put)


def _get(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


class RetryingHandler(pafs.FileSystemHandler):
    """`fs` with every call retried (see the module docstring); `prefix` (`s3://`) names keys
    in errors as users know them."""

    def __init__(self, fs: pafs.FileSystem, prefix: str = "") -> None:
        self.fs, self.prefix = fs, prefix

    def call(self, operation: str, path: str, fn: Callable[[], T]) -> T:
        return call(operation, self.prefix + path, fn)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RetryingHandler) and self.fs.equals(other.fs)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return self.fs.type_name  # "s3": what decides how a commit is published

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.call("HEAD", paths[0] if len(paths) == 1 else f"{len(paths)} keys",
                         lambda: self.fs.get_file_info(paths))

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.call("LIST", selector.base_dir, lambda: self.fs.get_file_info(selector))

    def create_dir(self, path: str, recursive: bool) -> None:
        self.call("PUT", path, lambda: self.fs.create_dir(path, recursive=recursive))

    def delete_dir(self, path: str) -> None:
        self.call("DELETE", path, lambda: self.fs.delete_dir(path))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.call("DELETE", path, lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok))

    def delete_root_dir_contents(self) -> None:
        self.call("DELETE", "/", lambda: self.fs.delete_dir_contents("/", accept_root_dir=True))

    def delete_file(self, path: str) -> None:
        self.call("DELETE", path, lambda: self.fs.delete_file(path))

    def move(self, src: str, dest: str) -> None:
        self.call("MOVE", f"{src} -> {dest}", lambda: self.fs.move(src, dest))

    def copy_file(self, src: str, dest: str) -> None:
        self.call("COPY", f"{src} -> {dest}", lambda: self.fs.copy_file(src, dest))

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return pa.BufferReader(self.call("GET", path, lambda: _get(self.fs, path)))

    def open_input_file(self, path: str) -> pa.NativeFile:
        return pa.BufferReader(self.call("GET", path, lambda: _get(self.fs, path)))

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return pa.PythonFile(_PutOnClose(self, path, metadata), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        raise NotImplementedError(f"{self.prefix}{path}: object stores have no appends")


def retrying(fs: pafs.FileSystem, prefix: str = "") -> pafs.FileSystem:
    """`fs` wrapped in `RetryingHandler` (a local disk as it is)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return fs
    return pafs.PyFileSystem(RetryingHandler(fs, prefix))
