"""Errors and problem reports of the MEG Store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Problem", "Severity", "StoreError"]

Severity = Literal["error", "warning"]


class StoreError(Exception):
    """A store file cannot be used: unreadable, truncated, foreign, of the wrong schema, or
    cannot be written.

    The message always names the file; ``path`` holds it (a local path or ``s3://...`` URI).
    """

    def __init__(self, message: str, path: str | None = None, reason: str = "unreadable") -> None:
        super().__init__(message)
        self.path = path
        #: ``unreadable`` (not Parquet, truncated, I/O error), ``schema`` (foreign columns),
        #: ``missing`` (no store at this path) or ``unwritable`` (read-only or full disk).
        self.reason = reason


@dataclass(frozen=True)
class Problem:
    """One finding of ``check_store`` or ``MEGStore.audit``.

    ``error`` means data is unreadable, lost or wrong (readers fail or return wrong rows);
    ``warning`` means something to clean up that readers already tolerate (a stale staging
    file of a killed writer, duplicate rows that readers deduplicate).
    """

    #: Short machine-readable category, e.g. ``unreadable``, ``schema``, ``stale_staging``.
    kind: str
    #: The file or directory concerned (local path or ``s3://...``), or the partition.
    path: str
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        return f"{self.severity.upper():7s} {self.kind:16s} {self.path}: {self.message}"
