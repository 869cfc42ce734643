"""Atomic writes on local disk: a file or folder appears whole under its name, or not at all.

Every writer in the project that publishes a local file for another process (store fragments,
weights, trainer states, fault counters, caches) goes through these: a uniquely named temp
sibling (or a temp file in `tmp_dir`, on the same filesystem), renamed onto the target when the
block ends without error, deleted when it raises. rename(2) replaces the target atomically, so a
reader sees the old content or the new one, never half of either.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_folder", "atomic_path", "fsync_path"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's (or a folder's entries') data to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(target: str | os.PathLike[str], *, tmp_dir: str | os.PathLike[str] | None = None,
                fsync: bool = False) -> Iterator[Path]:
    """A temp path to write; renamed onto `target` when the block ends, removed if it raises.

    `tmp_dir`: where the temp file goes (default: beside `target`); it must be on the same
    filesystem. `fsync`: flush the file before the rename and the folder's entry after it. A
    target folder that vanished meanwhile is made again once."""
    target = Path(target)
    if tmp_dir is None:  # a hidden sibling
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    else:
        Path(tmp_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(tmp_dir) / f"{uuid.uuid4().hex}.{target.name}.tmp"
    try:
        try:
            yield tmp
            if fsync:
                fsync_path(tmp)
            try:
                os.replace(tmp, target)
            except FileNotFoundError:
                if not tmp.exists():
                    raise
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, target)
            if fsync:
                fsync_path(target.parent)
        except OSError as exc:
            if exc.filename is None and exc.errno is not None:  # a full disk's write names no file
                raise type(exc)(exc.errno, exc.strerror, str(target)) from exc
            raise
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # undeletable: keep the original error, if any
            pass


@contextmanager
def atomic_file(target: str | os.PathLike[str], *, tmp_dir: str | os.PathLike[str] | None = None,
                fsync: bool = False) -> Iterator[BinaryIO]:
    """`atomic_path`, opened for binary writing (writes larger than the buffer go straight to
    the file, without another copy)."""
    with atomic_path(target, tmp_dir=tmp_dir, fsync=fsync) as tmp, open(tmp, "wb") as f:
        yield f


@contextmanager
def atomic_folder(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A temp folder beside `target` to fill; renamed onto `target` when the block ends.

    For caches that several processes may build at once from the same inputs: if `target`
    appeared meanwhile (another process won the race), theirs is kept and this one deleted.
    Nothing is renamed if the block raises."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
