"""Pictures of a run, drawn with matplotlib from what the run folder holds.

- `timeline.png`: one lane per worker, each op a bar coloured by kind (hue) and agent (shade),
  instance moves and trainer swaps marked, idle time the white between bars; several runs
  (e.g. the synchronous baseline and the co-design) stack on one time axis.
- `curves.png`: per-agent reward, team accuracy, tokens/s and utilisation over iterations.

Both PNGs carry their lanes or series in the file's metadata (`flexmarl-lanes`,
`flexmarl-series`), so a test or a script can check what was drawn without reading pixels.

    flexmarl report RUN [--compare RUN2]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from flexmarl_core.driver.metrics import metric_agents

#: one hue family per op kind; agents get shades of it
KIND_COLOURS = {"rollout": "Blues", "reward": "Greys", "train": "Oranges", "step": "Reds", "sync": "Greens",
                "program": "Purples", "value": "YlOrBr"}


@dataclass
class RunTrace:
    """What a timeline needs of one run: its ops (worker, kind, agent, start, end) and its
    control decisions, times relative to the run's first op."""

    label: str
    ops: list[dict[str, Any]]
    moves: list[dict[str, Any]]
    swaps: list[dict[str, Any]]

    @property
    def workers(self) -> list[str]:
        return sorted({o["worker"] for o in self.ops})

    @property
    def span(self) -> float:
        return max((o["end"] for o in self.ops), default=0.0)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of an interrupted run
    return out


def load_trace(run_dir: str | Path, label: str | None = None) -> RunTrace:
    """A run's trace from `metrics/ops.jsonl` and `metrics/decisions.jsonl`."""
    metrics = Path(run_dir) / "metrics"
    rows = _jsonl(metrics / "ops.jsonl")
    if not rows:
        raise FileNotFoundError(f"{metrics / 'ops.jsonl'}: no op log (is {run_dir} a finished or resumed run?)")
    t0 = min(r["t_start"] for r in rows)
    # A program op's work is its decodes on the agents' instances (`busy`), not its own span.
    ops = [{"worker": w, "kind": r["kind"], "agent": r.get("agent", ""), "start": a - t0, "end": b - t0}
           for r in rows for w, a, b in (r.get("busy") or [(r["worker"], r["t_start"], r["t_end"])])]
    names = metrics / "workers.json"  # decisions name workers by address, ops by name
    by_addr = json.loads(names.read_text()) if names.exists() else {}
    decisions = _jsonl(metrics / "decisions.jsonl")
    moves = [{"t": d["t"] - t0, "worker": by_addr.get(d["worker"], d["worker"]), "to": d["to_agent"]}
             for d in decisions if d.get("decision") == "move_instance"]
    swaps = [{"t": d["t"] - t0, "worker": by_addr.get(d["worker"], d["worker"]), "agent": d["agent"]}
             for d in decisions if d.get("decision") == "train_slot" and d.get("swap")]
    return RunTrace(label or Path(run_dir).name, ops, moves, swaps)


def _colour(kind: str, agent: str, agents: Sequence[str]) -> Any:
    cmap = matplotlib.colormaps[KIND_COLOURS.get(kind, "Purples")]
    if kind == "reward" or not agents:
        return cmap(0.55)
    i = agents.index(agent) if agent in agents else 0
    return cmap(0.45 + 0.45 * i / max(len(agents) - 1, 1))


def timeline(traces: Sequence[RunTrace], path: str | Path, *, title: str = "") -> Path:
    """Draw the runs' lanes on one time axis (each run's time from its own first op)."""
    agents = sorted({o["agent"] for t in traces for o in t.ops if o["agent"]})
    lanes = [(t, w) for t in traces for w in t.workers]
    fig = Figure(figsize=(12, 1.9 + 0.5 * len(lanes)))
    ax = fig.subplots()
    for y, (t, w) in enumerate(lanes):
        ops = [o for o in t.ops if o["worker"] == w]
        ax.broken_barh([(o["start"], o["end"] - o["start"]) for o in ops], (y - 0.4, 0.8),
                       facecolors=[_colour(o["kind"], o["agent"], agents) for o in ops],
                       edgecolor="white", linewidth=0.3)
        busy = sum(o["end"] - o["start"] for o in ops)
        ax.text(t.span, y, f" busy {busy / max(t.span, 1e-9):.0%}", va="center", fontsize=7)
        for m in (m for m in t.moves if m["worker"] == w):
            ax.plot(m["t"], y + 0.45, marker="v", color="black", markersize=5)
        for s in (s for s in t.swaps if s["worker"] == w):
            ax.plot(s["t"], y - 0.45, marker="^", color="crimson", markersize=5)
    ax.set_yticks(range(len(lanes)), [f"{t.label}: {w}" if len(traces) > 1 else w for t, w in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first op")
    ax.set_xlim(0, max(t.span for t in traces) * 1.08)
    kinds = {o["kind"] for t in traces for o in t.ops}
    handles = [Patch(color=_colour(k, agents[len(agents) // 2] if agents else "", agents),
                     label="program (decodes)" if k == "program" else k)
               for k in KIND_COLOURS if k in kinds]
    handles += [Line2D([], [], marker="v", color="black", ls="", label="instance move"),
                Line2D([], [], marker="^", color="crimson", ls="", label="trainer swap")]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles),
              fontsize=8, frameon=False)
    # The title sits above the legend row (pad: the legend's height in points).
    ax.set_title(title or "ops per worker (shade: agent " + ", ".join(agents) + ")", fontsize=10, pad=22)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"flexmarl-lanes": json.dumps([[t.label, w] for t, w in lanes])})
    return out


def curves(per_it: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Per-agent reward and team accuracy, tokens/s, utilisation, by iteration."""
    its = [m["iteration"] for m in per_it]
    agents = metric_agents(per_it)
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    series = []
    for a in agents:
        axes[0].plot(its, [m.get(f"agent/{a}/reward", float("nan")) for m in per_it], marker="o", label=f"reward {a}")
        series.append(f"agent/{a}/reward")
    axes[0].plot(its, [m["accuracy"] for m in per_it], marker="s", color="black", label="team accuracy")
    series.append("accuracy")
    axes[0].set_title("reward and accuracy (training batches)", fontsize=10)
    axes[0].legend(fontsize=7)
    axes[1].plot(its, [m["tokens_per_s"] for m in per_it], marker="o")
    axes[1].set_title("tokens/s", fontsize=10)
    axes[2].plot(its, [m["utilization"] for m in per_it], marker="o")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_title("utilisation (busy share of workers)", fontsize=10)
    series += ["tokens_per_s", "utilization"]
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"flexmarl-series": json.dumps(series)})
    return out


def report(run_dir: str | Path, compare: str | Path | None = None, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Both pictures of a finished (or resumed) run; with `compare`, the timeline stacks the
    other run above this one. Written to `out_dir` (default: the run folder)."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir else run_dir
    traces = [load_trace(compare, Path(compare).name)] if compare else []
    traces.append(load_trace(run_dir, run_dir.name))
    per_it = _jsonl(run_dir / "metrics" / "iterations.jsonl")
    paths = {"timeline": timeline(traces, out / "timeline.png")}
    if per_it:
        paths["curves"] = curves(per_it, out / "curves.png", title=run_dir.name)
    return paths
