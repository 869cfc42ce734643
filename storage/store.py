"""The MEG Store: per-agent sample tables, status logs and the inputs table as Parquet fragments.

See the package docstring (``storage/__init__.py``) for the layout on disk and the rules
(atomic commits, idempotency, status folding, compaction). :class:`MEGStore` is made of one
part per concern, each in its own module:

* ``fs``      -- URIs, the directory layout, listing (:class:`~storage.fs.StoreFiles`);
* ``commit``  -- publishing a fragment atomically, staging clean-up;
* ``write``   -- validating rows and naming fragments by content;
* ``read``    -- reading fragments and partitions (deduplication and folding: ``fold``);
* ``compact`` -- folding a partition into one fragment;
* ``audit``   -- the exactly-once check of a partition.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs

from .audit import Auditor
from .compact import Compactor
from .errors import StoreError
from .fs import FORMAT_VERSION, MARKER, commit_mode, open_filesystem, os_reason
from .write import Rows, Writer

__all__ = ["MARKER", "MEGStore", "Rows", "open_filesystem"]


class MEGStore(Writer, Compactor, Auditor):
    """Per-agent sample tables, status logs and inputs on any ``pyarrow.fs`` filesystem.

    >>> store = MEGStore("/tmp/run1/store")                             # doctest: +SKIP
    >>> store.write_samples("solver", 0, rows)                          # doctest: +SKIP
    >>> store.write_status("solver", 0, [{"sample_id": ..., "policy_version": 0,
    ...                                   "mb": 0, "reward": 1.0}])     # doctest: +SKIP
    >>> batch = store.ready("solver", 0, mb=0)                          # doctest: +SKIP

    Thread/process safety: any number of processes may write and read one store at once;
    each write is one or more whole fragments made visible atomically.

    Args:
        uri: local path, ``file://`` URI or ``s3://bucket/prefix``.
        filesystem: an existing ``pyarrow.fs.FileSystem``; then ``uri`` is a path inside it.
        create: write the store marker if missing; if False a missing marker is an error.
        fsync: local disk only; fsync each fragment and its directory before the rename, so
            a committed fragment survives a power loss (a crashed *process* never needs it).
        compression: Parquet codec of new fragments.
        fs_kwargs: passed to ``pyarrow.fs.S3FileSystem`` for ``s3://`` URIs.
    """

    def __init__(
        self,
        uri: str,
        *,
        filesystem: pafs.FileSystem | None = None,
        create: bool = True,
        fsync: bool = False,
        compression: str = "snappy",
        **fs_kwargs: Any,
    ) -> None:
        self.fs, self.root, self._prefix = open_filesystem(uri, filesystem, **fs_kwargs)
        self.uri = uri
        self.fsync = fsync
        self.compression = compression
        self._commit_mode = commit_mode(self.fs, uri)
        self._known_dirs = set()
        marker = f"{self.root}/{MARKER}"
        if self.fs.get_file_info(marker).type != pafs.FileType.File:
            if not create:
                raise StoreError(
                    f"no MEG store at {self.display(self.root)} (no {MARKER})",
                    self.display(self.root),
                    "missing",
                )
            body = json.dumps({"format_version": FORMAT_VERSION, "kind": "flexmarl MEG store"})
            try:
                self._put_bytes(self.root, MARKER, body.encode())
            except OSError as e:
                raise StoreError(
                    f"cannot create a MEG store at {self.display(self.root)}: {os_reason(e)}",
                    self.display(self.root),
                    "unwritable",
                ) from e

    def __repr__(self) -> str:
        return f"MEGStore({self.display(self.root)!r})"
