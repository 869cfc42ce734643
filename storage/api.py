"""The store contract: what the stages and the run need from a MEG Store. A Protocol only;
`MEGStore` (`store.py`) implements it on any `pyarrow.fs` filesystem."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

#: Rows to write: a list of dicts (one per row) or an Arrow table.
Rows = Sequence[Mapping[str, Any]] | pa.Table


@runtime_checkable
class Store(Protocol):
    """Per-agent sample tables, their status logs and the inputs table of a run.

    Writes are idempotent by (`sample_id`, `policy_version`) (inputs: by `input_id`) and each is
    visible whole or not at all; status changes are appended, never edited in place, and reads
    fold them into the samples."""

    uri: str

    def write_samples(self, agent: str, iteration: int, rows: Rows) -> list[str]:
        """An agent's samples of one iteration; the fragments written (one per micro-batch)."""
        ...

    def write_status(self, agent: str, iteration: int, rows: Rows) -> list[str]:
        """Status changes (reward, advantage, value, consumed_step) of samples already written."""
        ...

    def mark_consumed(self, agent: str, iteration: int, samples: Rows, step: int,
                      advantages: Sequence[float] | None = None) -> list[str]:
        """Status rows: optimizer step `step` trained on `samples` (with their advantages)."""
        ...

    def write_inputs(self, iteration: int, rows: Rows) -> str:
        """The inputs of one iteration; the fragment written."""
        ...

    def read_samples(self, agent: str, iteration: int | None = None, mb: int | None = None,
                     columns: Sequence[str] | None = None) -> pa.Table:
        """An agent's samples, deduplicated, their status folded in."""
        ...

    def ready(self, agent: str, iteration: int, need: Iterable[str] = ("reward",), unconsumed: bool = True,
              mb: int | None = None, policy_version: int | None = None,
              columns: Sequence[str] | None = None) -> pa.Table:
        """Samples whose `need` fields are set (and, `unconsumed`, not trained on yet)."""
        ...

    def read_inputs(self, iteration: int | None = None, split: str | None = None) -> pa.Table:
        """The inputs of one iteration (or all), one row per input_id."""
        ...
