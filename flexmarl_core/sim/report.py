"""What the simulator prints and draws: the paper's tables (simulated) and a timeline picture
with one lane per device group.

`timeline_png` takes op records, simulated or real (`StageResult.from_row` of an op log), so
both draw the same way; the title says which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flexmarl_core.ops import OpRecord

LABEL = "simulated"

_KIND_COLOURS = {"reward": "#999999", "step": "#222222", "sync": "#d62728"}


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


def timeline_png(records: Sequence[OpRecord], path: str | Path, title: str,
                 pools: Mapping[str, str] | None = None) -> Path:
    """Gantt chart of `records`: one lane per worker (device group), grouped by pool, a bar
    per op coloured by agent (rollout, train) or kind (reward, step, sync)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pools = pools or {}
    workers = sorted({r.result.worker for r in records}, key=lambda w: (pools.get(w, ""), w))
    lane = {w: i for i, w in enumerate(workers)}
    agents = sorted({r.op.agent for r in records if r.op.agent})
    cmap = matplotlib.colormaps["tab10" if len(agents) <= 10 else "tab20"]
    colour = {a: matplotlib.colors.to_hex(cmap(i % cmap.N)) for i, a in enumerate(agents)}
    t0 = min((r.result.t_start for r in records), default=0.0)
    height = min(max(2.5, 0.18 * len(workers) + 1.5), 40)
    fig, ax = plt.subplots(figsize=(14, height))
    bars: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for r in records:
        key = (r.result.worker, _KIND_COLOURS.get(r.op.kind) or colour[r.op.agent],
               "////" if r.op.kind == "train" else "")
        bars.setdefault(key, []).append((r.result.t_start - t0, max(r.result.seconds, 1e-9)))
    for (w, c, hatch), spans in bars.items():
        ax.broken_barh(spans, (lane[w] - 0.4, 0.8), facecolors=c, edgecolor="white", linewidth=0.2,
                       hatch=hatch)
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels([f"{pools[w]}:{w}" if w in pools else w for w in workers],
                       fontsize=max(3, min(8, 400 // max(len(workers), 1))))
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles = [Patch(color=colour[a], label=f"{a} (rollout; train hatched)") for a in agents]
    handles += [Patch(color=c, label=k) for k, c in _KIND_COLOURS.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
