"""Where a run's time went on its critical path: from the op that finished last, back through
the dependency each op waited for last (`critical_path` over finished records, `CriticalPath`
as the run goes)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from flexmarl_core.ops import Op, OpRecord

__all__ = ["CriticalPath", "critical_path"]


def critical_path(records: list[OpRecord], deps: dict[Any, list[Any]]) -> dict[str, Any]:
    """Where the run's time went on its critical path: from the op that finished last, walk
    back through the dependency that finished last. Seconds per stage kind on the path, and
    `wait_s`: time an op on the path was ready but not yet running (queued behind other work
    on its worker, or dispatch overhead)."""
    if not records:
        return {}
    by_op = {r.op: r for r in records}
    cur: OpRecord | None = max(records, key=lambda r: r.result.t_end)
    out: dict[str, Any] = defaultdict(float)
    ops = 0
    while cur is not None:
        ops += 1
        res = cur.result
        out[f"stage_s/{cur.op.kind}"] += res.seconds
        parents = [by_op[d] for d in deps.get(cur.op, []) if d in by_op]
        gate = max(parents, key=lambda r: r.result.t_end, default=None)
        ready_at = gate.result.t_end if gate else cur.submitted
        out["wait_s"] += max(res.t_start - ready_at, 0.0)
        cur = gate
    out["ops"] = ops
    return dict(out)


class CriticalPath:
    """`critical_path` kept as the run goes, in memory bounded by the plan's window: each op's
    path (the gate it waited for last, and that one's path) is folded into a summary when it is
    recorded, and the summaries of iterations no op still to come can wait for are dropped.
    `deps(op)`: the op's dependencies; `sizes`: ops per iteration; `reach`: how many
    iterations back a dependency goes (`Plan.reach`)."""

    def __init__(self, deps: Callable[[Op], list[Op]], sizes: dict[int, int], reach: int) -> None:
        self.deps, self.left, self.reach = deps, dict(sizes), reach
        #: op -> (its end, its path's summary)
        self._paths: dict[Op, tuple[float, dict[str, float]]] = {}
        self._last: tuple[float, dict[str, float]] | None = None
        self._open = min(sizes, default=0)  # the lowest iteration with an op not recorded

    def add(self, rec: OpRecord) -> None:
        """`rec`, after every record of its dependencies (the op log's order)."""
        res = rec.result
        parents = [self._paths[d] for d in self.deps(rec.op) if d in self._paths]
        gate = max(parents, key=lambda p: p[0], default=None)
        path = dict(gate[1]) if gate else {"ops": 0}
        key = f"stage_s/{rec.op.kind}"
        path[key] = path.get(key, 0.0) + res.seconds
        path["wait_s"] = path.get("wait_s", 0.0) + max(res.t_start - (gate[0] if gate else rec.submitted), 0.0)
        path["ops"] += 1
        self._paths[rec.op] = (res.t_end, path)
        if self._last is None or res.t_end > self._last[0]:
            self._last = (res.t_end, path)
        it = rec.op.iteration
        if it in self.left:
            self.left[it] -= 1
        while self.left.get(self._open) == 0:
            del self.left[self._open]
            self._open += 1
            keep = self._open - self.reach  # what an op still to come can wait for
            self._paths = {op: p for op, p in self._paths.items() if op.iteration >= keep}

    def summary(self) -> dict[str, Any]:
        """Seconds per stage kind on the path, `wait_s` and `ops` (as `critical_path`)."""
        if self._last is None:
            return {}
        out = dict(self._last[1])
        out["ops"] = out.pop("ops")  # last, as `critical_path` has it
        return out
