"""Per-iteration metrics from the orchestrator's op records, written as JSONL and TensorBoard.

Iterations overlap under the async pipeline, so an iteration's window is from the end of the
previous iteration's last op to the end of its own last op; busy time of every worker is the
overlap of its ops (whatever iteration they belong to) with that window.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.orchestrator import OpRecord, RunResult


def _window_busy(records: list[OpRecord], lo: float, hi: float) -> dict[str, float]:
    busy: dict[str, float] = defaultdict(float)
    for r in records:
        s, e = r.result["t_start"], r.result["t_end"]
        busy[r.result["worker"]] += max(0.0, min(e, hi) - max(s, lo))
    return dict(busy)


def iteration_metrics(result: RunResult, cfg: ExperimentConfig) -> list[dict[str, Any]]:
    recs = result.records
    workers = sorted({r.result["worker"] for r in recs})
    by_it: dict[int, list[OpRecord]] = defaultdict(list)
    for r in recs:
        by_it[r.op.iteration].append(r)
    out = []
    prev_end = min((r.result["t_start"] for r in recs), default=result.started)
    for it in sorted(by_it):
        ops = by_it[it]
        end = max(r.result["t_end"] for r in ops)
        window = max(end - prev_end, 1e-9)
        busy = _window_busy(recs, prev_end, end)
        stage_s: dict[str, float] = defaultdict(float)
        for r in ops:
            stage_s[r.op.kind] += r.result["t_end"] - r.result["t_start"]
        tokens = sum(r.result.get("tokens", 0) for r in ops if r.op.kind == "rollout")
        rewards: dict[str, list[float]] = defaultdict(list)
        acc = []
        for r in ops:
            if r.op.kind == "reward":
                for a, v in r.result["reward"].items():
                    rewards[a].append(v)
                acc.append(r.result["accuracy"])
        m: dict[str, Any] = {
            "iteration": it,
            "e2e_s": window,
            "tokens": tokens,
            "tokens_per_s": tokens / window,
            "utilization": sum(busy.values()) / (window * max(len(workers), 1)),
            "accuracy": sum(acc) / max(len(acc), 1),
            "cpu_s": sum(r.result.get("cpu_s", 0.0) for r in ops),
            "ops": len(ops),
        }
        # Swap traffic of on-demand training allocation (checkpoint out after each step, state
        # in where a slot took an agent whose state was elsewhere).
        for key in ("swap_in_s", "swap_in_bytes", "swap_out_s", "swap_out_bytes"):
            m[key] = sum(r.result.get(key, 0.0) for r in ops)
        moves = [d for d in result.decisions
                 if d["decision"] == "move_instance" and prev_end < d["t"] <= end]
        m["balance_moves"] = len(moves)
        m["train_swaps"] = sum(1 for d in result.decisions
                               if d["decision"] == "train_slot" and d["iteration"] == it and d["swap"])
        m.update({f"stage_s/{k}": v for k, v in sorted(stage_s.items())})
        m.update({f"busy_s/{w}": busy.get(w, 0.0) for w in workers})
        m.update({f"reward/{a}": sum(v) / len(v) for a, v in sorted(rewards.items())})
        out.append(m)
        prev_end = end
    return out


def critical_path(records: list[OpRecord], deps: dict[Any, list[Any]]) -> dict[str, Any]:
    """Where the run's time went on its critical path: from the op that finished last, walk
    back through the dependency that finished last. Seconds per stage kind on the path, and
    `wait_s`: time an op on the path was ready but not yet running (queued behind other work
    on its worker, or dispatch overhead)."""
    if not records:
        return {}
    by_op = {r.op: r for r in records}
    cur: OpRecord | None = max(records, key=lambda r: r.result["t_end"])
    out: dict[str, Any] = defaultdict(float)
    ops = 0
    while cur is not None:
        ops += 1
        res = cur.result
        out[f"stage_s/{cur.op.kind}"] += res["t_end"] - res["t_start"]
        parents = [by_op[d] for d in deps.get(cur.op, []) if d in by_op]
        gate = max(parents, key=lambda r: r.result["t_end"], default=None)
        ready_at = gate.result["t_end"] if gate else cur.submitted
        out["wait_s"] += max(res["t_start"] - ready_at, 0.0)
        cur = gate
    out["ops"] = ops
    return dict(out)


def run_summary(per_it: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Whole-run figures: mean E2E per iteration, tokens/s and utilisation over the run."""
    if not per_it:
        return {"iterations": 0, "wall_s": wall_s}
    span = sum(m["e2e_s"] for m in per_it)
    return {
        "iterations": len(per_it),
        "wall_s": wall_s,
        "e2e_s_per_iteration": span / len(per_it),
        "tokens_per_s": sum(m["tokens"] for m in per_it) / span,
        "utilization": sum(m["utilization"] * m["e2e_s"] for m in per_it) / span,
        "final_accuracy": per_it[-1]["accuracy"],
        "final_reward": {k.split("/", 1)[1]: v for k, v in per_it[-1].items() if k.startswith("reward/")},
    }


class MetricsWriter:
    """Appends op records and iteration metrics under `run_dir/metrics/`, plus TensorBoard."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir) / "metrics"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._ops = open(self.dir / "ops.jsonl", "a")  # noqa: SIM115 - closed in close()
        self._tb: Any = None

    def op(self, rec: OpRecord) -> None:
        row = {"op": rec.op.name, "kind": rec.op.kind, "iteration": rec.op.iteration,
               "agent": rec.op.agent, "turn": rec.op.turn, "mb": rec.op.mb, "submitted": rec.submitted,
               "finished": rec.finished, **rec.result}
        self._ops.write(json.dumps(row, default=str) + "\n")
        self._ops.flush()

    def decisions(self, decisions: list[dict[str, Any]]) -> None:
        """Every control-plane decision (instance moves, training slots) as JSONL."""
        with open(self.dir / "decisions.jsonl", "a") as f:
            for d in decisions:
                f.write(json.dumps(d, default=str) + "\n")

    def iteration(self, m: dict[str, Any]) -> None:
        with open(self.dir / "iterations.jsonl", "a") as f:
            f.write(json.dumps(m) + "\n")
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        for k, v in m.items():
            if k != "iteration" and isinstance(v, int | float):
                self._tb.add_scalar(k, v, m["iteration"])

    def close(self) -> None:
        self._ops.close()
        if self._tb is not None:
            self._tb.close()
