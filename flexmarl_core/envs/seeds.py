"""Problems for an environment team: each is one deal (an episode seed, from its input id),
played group-size times per iteration. Use as `workload: {kind: callable, callable:
flexmarl_core.envs.seeds:episodes}`; the held-out ones are the evaluation's episodes, whose
"answer" is a win (`teams/environment.py` `WIN`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def episodes(n: int = 4096, heldout: int = 256) -> Iterator[dict[str, Any]]:
    """`n` training deals and `heldout` held-out ones."""
    for k in range(n + heldout):
        yield {"id": f"deal{k}", "question": f"episode {k}", "answer": "win",
               "split": "train" if k < n else "heldout"}
