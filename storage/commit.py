"""The commit protocol of the MEG Store: publish a whole fragment atomically, or nothing.

Local disk: stage under ``_staging/`` and rename into place. Object stores: one whole-object
PUT. See :meth:`Committer._commit`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .atomic import atomic_file
from .errors import StoreError
from .fs import STAGING, StoreFiles, os_reason

__all__ = ["Committer"]

_STREAM_BYTES = 16 << 20  # fragments bigger than this (in memory) stream to disk


class Committer(StoreFiles):
    """Writing fragments into a store, and cleaning up after writers that died."""

    fsync: bool
    compression: str
    #: Directories known to exist, so that a commit does not ask the filesystem each time.
    _known_dirs: set[str]

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._known_dirs:
            self.fs.create_dir(directory, recursive=True)
            self._known_dirs.add(directory)

    def _commit(self, table: pa.Table, directory: str, name: str) -> str:
        """Make ``directory/name`` hold exactly ``table``, atomically. Returns the path.

        Local disk: write a uniquely named temp file under ``_staging/`` and rename it into
        place; rename(2) is atomic and replaces an existing file, so readers see the old or the
        new fragment, never a partial one, and a retried write simply replaces its own file.
        A writer killed mid-write leaves only a temp file in ``_staging/``, which readers never
        look at (``check_store`` reports it once it is stale). Small fragments are encoded in
        memory and written with one syscall (~2x faster than many small writes); big ones
        stream into the temp file to bound memory.

        Object stores (S3, GCS) have no atomic rename, but an object becomes visible only when
        its upload completes (single PUT, or a multipart upload completed at close), and a PUT
        atomically replaces an object of the same key. So the fragment is serialised in memory
        first (an error while encoding can then never publish a partial object) and written
        straight to its final key.
        """
        path = f"{directory}/{name}"
        try:
            return self._commit_fragment(table, directory, path)
        except OSError as e:
            # A read-only or full disk, a permission error, a file size limit: name the
            # fragment (its partition) instead of the temp file; nothing was published.
            raise StoreError(
                f"cannot write store fragment {self.display(path)}: {os_reason(e)}; nothing "
                "of this write is visible to readers",
                self.display(path),
                "unwritable",
            ) from e

    def _commit_fragment(self, table: pa.Table, directory: str, path: str) -> str:
        name = path.rsplit("/", 1)[1]
        opts = {
            "compression": self.compression,
            # Token ids are near-random: dictionary pages cost time and save nothing there.
            "use_dictionary": ["input_id", "prompt_text", "sample_id"],
            "write_statistics": ["mb", "policy_version", "traj"],
            "row_group_size": 8192,
        }
        if self._commit_mode == "put" or table.nbytes <= _STREAM_BYTES:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, **opts)
            self._put_bytes(directory, name, sink.getvalue(), self.fsync)
        else:
            self._stage_and_rename(
                directory, name, lambda f: pq.write_table(table, f, **opts), self.fsync
            )
        return path

    def _put_bytes(
        self, directory: str, name: str, data: bytes | pa.Buffer, fsync: bool = False
    ) -> None:
        """Publish ``data`` as ``directory/name`` atomically (the marker, small fragments)."""
        if self._commit_mode == "rename":
            self._stage_and_rename(directory, name, lambda f: f.write(data), fsync)
            return
        # One write then close: the object appears only when close() completes the upload.
        out = self.fs.open_output_stream(f"{directory}/{name}")
        out.write(data)
        out.close()

    def _stage_and_rename(
        self, directory: str, name: str, write: Callable[[BinaryIO], object], fsync: bool
    ) -> None:
        """Local disk: ``write`` a unique temp file under ``_staging/``, rename it into place
        (a partition directory deleted by hand meanwhile is made again)."""
        self._ensure_dir(directory)
        with atomic_file(f"{directory}/{name}", tmp_dir=f"{self.root}/{STAGING}", fsync=fsync) as f:
            write(f)

    def clean_staging(self, older_than_s: float = 3600.0) -> list[str]:
        """Delete temp files of writers that died mid-write; returns what was deleted.

        Only files older than ``older_than_s`` are touched, so running writers are safe.
        Object stores have no staging files (incomplete uploads are invisible; expire them
        with a bucket lifecycle rule).
        """
        staging = f"{self.root}/{STAGING}"
        infos = self.fs.get_file_info(pafs.FileSelector(staging, allow_not_found=True))
        cutoff = time.time() - older_than_s
        removed = []
        for info in infos:
            if (
                info.type == pafs.FileType.File
                and info.mtime is not None
                and info.mtime.timestamp() <= cutoff
            ):
                self._delete(info.path)
                removed.append(self.display(info.path))
        return removed
