"""What the simulator prints and draws: the paper's tables (simulated) and a timeline picture
with one lane per device group, drawn by the same `plots.timeline` as a real run's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flexmarl_core.control import Decision, MoveInstance, TrainSlot
from flexmarl_core.driver.plots import RunTrace, timeline
from flexmarl_core.ops import OpRecord

LABEL = "simulated"


def mode_table(title: str, rows: Mapping[str, Mapping[str, Any]], baseline: str | None = None) -> str:
    """One line per mode: steady-state E2E per iteration and tokens/s (iterations after the
    first), utilisation per pool over the run, and the ratio to `baseline` (its E2E over the
    row's); every figure is labelled simulated."""
    pools = sorted({p for s in rows.values() for p in s.get("utilization_per_pool", {})})
    head = f"{'mode':30s} {'E2E s/it':>10s} {'tokens/s':>10s} " + " ".join(f"{'util ' + p:>16s}" for p in pools)
    if baseline:
        head += f" {'speedup vs ' + baseline:>20s}"
    lines = [f"{title} ({LABEL})", head]
    for mode, s in rows.items():
        line = f"{mode:30s} {s['e2e_s_steady']:10.1f} {s['tokens_per_s_steady']:10.0f} "
        line += " ".join(f"{s['utilization_per_pool'].get(p, 0.0):16.2f}" for p in pools)
        if baseline:
            line += f" {rows[baseline]['e2e_s_steady'] / s['e2e_s_steady']:19.2f}x"
        lines.append(line)
    lines.append("E2E and tokens/s: steady state, the iterations after the first (simulated)")
    return "\n".join(lines)


def trace(records: Sequence[OpRecord], decisions: Sequence[Decision], label: str) -> RunTrace:
    """A simulated run as the real runs' timeline draws it (`plots.timeline`): one lane per
    worker (device group), instance moves and trainer swaps marked."""
    t0 = min((r.result.t_start for r in records), default=0.0)
    ops = [{"worker": r.result.worker, "kind": r.op.kind, "agent": r.op.agent,
            "start": r.result.t_start - t0, "end": r.result.t_end - t0} for r in records]
    moves = [{"t": d.t - t0, "worker": d.worker, "to": d.to_agent} for d in decisions if isinstance(d, MoveInstance)]
    swaps = [{"t": d.t - t0, "worker": d.worker, "agent": d.agent}
             for d in decisions if isinstance(d, TrainSlot) and d.swap]
    return RunTrace(label, ops, moves, swaps)


def timeline_png(records: Sequence[OpRecord], decisions: Sequence[Decision], path: str | Path,
                 title: str) -> Path:
    """The simulated run's timeline, drawn like a real run's; the title says simulated."""
    return timeline([trace(records, decisions, LABEL)], path, title=f"{title} ({LABEL})")
