"""Dask resource tags: how the control plane says where work may run.

A worker tagged `rollout:<agent>` hosts an inference instance dedicated to that agent; a plain
`rollout` tag serves any agent. `train` marks a training slot. Tags change at run time (the
balancer re-tags workers), which is how load moves between agents.
"""

from __future__ import annotations

ROLLOUT_TAG = "rollout"
TRAIN_TAG = "train"


def rollout_tag(agent: str) -> str:
    return f"{ROLLOUT_TAG}:{agent}"


def is_rollout_tag(tag: str) -> bool:
    """An inference instance's tag: `rollout` (any agent) or `rollout:<agent>`."""
    return tag == ROLLOUT_TAG or tag.startswith(f"{ROLLOUT_TAG}:")
