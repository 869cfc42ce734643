"""An iteration's own record in the Prefect UI: the lines its flow run logs and its artifact.

Each iteration's flow run (`tasks/iteration_runs.py`) logs the iteration's line (as the
terminal prints it), one line per control-plane decision made while it ran (instance moves,
training slots, resubmits, ...) and the ops of other flow runs it waited for, and carries a
markdown artifact: its figures, its ops with their workers and times, its decisions.

Prefect draws an edge only between task runs of one flow run, so the wait of a flow run's
first rollouts for the previous flow run's syncs is recorded (their task inputs) but not
drawn; the record names those ops and the flow run that holds them. Everything here is
formatting, done on the iteration runs' own thread, never on the orchestrator's.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any

from flexmarl_core.control import Decision
from flexmarl_core.driver.console import iteration_line
from flexmarl_core.driver.metrics import metric_agents
from flexmarl_core.ops import OpRecord, agent_key

_IT = re.compile(r" it=(\d+)")


def decision_iteration(d: Decision) -> int | None:
    """The iteration a decision belongs to: its own field, or its op's (None: neither)."""
    it = getattr(d, "iteration", None)
    if isinstance(it, int):
        return it
    m = _IT.search(str(getattr(d, "op", "")))
    return int(m.group(1)) if m else None


def describe(d: Decision) -> str:
    """One decision as a line a user reads, e.g. `train_slot: solver's training of iteration 3
    on w1 (its state swapped in from w0)`."""
    r = d.as_row()
    kind = r["decision"]
    if kind == "move_instance":
        line = f"worker {r['worker']} now serves {r['to_agent']}" + (
            f" instead of {r['from_agent']}" if r.get("from_agent") else " too")
        loads = ", ".join(f"{a} {v if isinstance(v, str) else f'{v:.2f}'}" for a, v in r["loads"].items())
        return f"{kind}: {line} (queued rollout s per instance: {loads})"
    if kind == "train_slot":
        swap = f" (its state swapped in from {r['state_was_on']})" if r.get("swap") else ""
        return f"{kind}: {r['agent']}'s training of iteration {r['iteration']} on {r['worker']}{swap}"
    if kind == "gradient_helper":
        return (f"{kind}: {r['agent']}'s micro-batch {r['mb']} trained on {r['worker']} while "
                f"{r['slot']} has {r['queued']} ops queued")
    if kind == "resubmit":
        return f"{kind}: {r['op']} run again (worker {r.get('worker') or '?'} lost: {r['error'].split(':')[0]})"
    if kind == "hung_op":
        return f"{kind}: {r['op']} on {r['worker']} ran past its {r['deadline_s']:.0f} s deadline; its worker restarted"
    if kind == "store_retries":
        return f"{kind}: {r['op']} on {r['worker']} rode out {r['retries']} store failures"
    rest = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("decision", "t"))
    return f"{kind}: {rest}"


@dataclass
class IterationRecord:
    """What one iteration's flow run shows (module docstring). `waited`: each of its ops that
    waited for ops of other flow runs, with their names; `where`: the name of the flow run that
    holds each iteration they belong to."""

    iteration: int
    row: dict[str, Any]
    ops: list[OpRecord] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    waited: dict[str, list[str]] = field(default_factory=dict)
    where: dict[int, str] = field(default_factory=dict)

    def waited_on(self) -> list[str]:
        """The ops of other flow runs this iteration's ops waited for, each once, in order."""
        return sorted({d for ds in self.waited.values() for d in ds}, key=lambda n: (_it(n), n))


def _it(name: str) -> int:
    m = _IT.search(name)
    return int(m.group(1)) if m else -1


def waits_line(rec: IterationRecord, run_name: str) -> str | None:
    """Where the iteration's undrawn edges lead, e.g. `waited on sync[solver] it=2 (in flow
    run arith-tiny it 2)`; None when it waited on no op of another flow run."""
    ops = rec.waited_on()
    if not ops:
        return None
    by_it: dict[int, list[str]] = {}
    for n in ops:
        by_it.setdefault(_it(n), []).append(n)
    parts = [f"{', '.join(ns)} (in flow run {rec.where.get(it, f'{run_name} it {it}')})" for it, ns in by_it.items()]
    return "waited on ops of other flow runs, drawn there: " + "; ".join(parts)


def log_lines(rec: IterationRecord, run_name: str, iterations: int) -> list[str]:
    """The iteration flow run's log: its line, its decisions, its waits."""
    lines = [iteration_line(rec.row, iterations)]
    lines += [describe(d) for d in rec.decisions]
    waits = waits_line(rec, run_name)
    if waits:
        lines.append(waits)
    return lines


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown(rec: IterationRecord, run_name: str, iterations: int) -> str:
    """The iteration's artifact: figures, ops (worker, start relative to the iteration's first
    op, seconds), decisions and waits."""
    m = rec.row
    out = [f"# {run_name} it {rec.iteration}", "", f"`{iteration_line(m, iterations)}`", ""]
    figures = [("E2E s", m.get("e2e_s")), ("tokens", m.get("tokens")), ("tokens/s", m.get("tokens_per_s")),
               ("utilisation", m.get("utilization")), ("accuracy", m.get("accuracy"))]
    figures += [(f"reward {a}", m.get(agent_key(a, "reward"))) for a in metric_agents([m])]
    if m.get("failed_trajectories"):
        figures.append(("failed trajectories", m["failed_trajectories"]))
    out += ["| figure | value |", "|---|---|", *(f"| {k} | {_fmt(v)} |" for k, v in figures if v is not None), ""]
    waits = waits_line(rec, run_name)
    if waits:
        out += [waits, ""]
    if rec.ops:
        ops = sorted(rec.ops, key=lambda r: (r.result.t_start, r.op.name))
        t0 = ops[0].result.t_start
        when = dt.datetime.fromtimestamp(t0, dt.UTC).isoformat(timespec="seconds")
        out += [f"## ops ({len(ops)} run by this attempt; start in s after {when})", "",
                "| op | worker | start | seconds | waited on (other flow runs) |", "|---|---|---|---|---|"]
        out += [f"| {r.op.name} | {r.result.worker} | {r.result.t_start - t0:.2f} | {r.result.seconds:.2f} | "
                f"{', '.join(rec.waited.get(r.op.name, []))} |" for r in ops]
        out.append("")
    else:
        out += ["Every op of this iteration ran in an earlier attempt of the run.", ""]
    if rec.decisions:
        out += ["## decisions", "", *(f"- {describe(d)}" for d in rec.decisions), ""]
    return "\n".join(out)
