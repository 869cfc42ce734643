"""The program op's commit record per micro-batch (`location.program_key`), as training and the
exactly-once audit read it: which of an agent's samples count."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from flexmarl_core.runfiles.location import RunLocation, program_key


def read_manifest(loc: RunLocation, iteration: int, mb: int) -> dict[str, Any] | None:
    """The manifest a program op committed for (`iteration`, `mb`), or None."""
    key = program_key(iteration, mb)
    return json.loads(loc.read_text(key)) if loc.is_file(key) else None


def committed_ids(loc: RunLocation, iteration: int, mbs: Iterable[int], agent: str) -> set[str]:
    """The sample ids of `agent` the program ops of `iteration` committed for `mbs`; a
    micro-batch without a manifest is an error (its op has not finished)."""
    ids: set[str] = set()
    for mb in mbs:
        man = read_manifest(loc, iteration, mb)
        if man is None:
            raise RuntimeError(f"iteration {iteration} micro-batch {mb}: no program manifest at "
                               f"{loc.display(program_key(iteration, mb))} (its program op has not committed)")
        ids.update(man["samples"].get(agent, []))
    return ids
