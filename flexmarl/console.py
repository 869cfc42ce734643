"""Terminal output of a run: a progress bar per iteration and the closing summary table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flexmarl_core.metrics import metric_agents
from flexmarl_core.ops import OpRecord, agent_key
from flexmarl_core.plan import Plan

console = Console()


class IterationProgress:
    """One bar per iteration, advanced as its ops complete (iterations overlap when async)."""

    def __init__(self, plan: Plan) -> None:
        self.progress = Progress(
            TextColumn("[bold]iteration {task.fields[it]}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[last]}"), TimeElapsedColumn(), console=console,
        )
        self.totals = plan.sizes()
        self.bars: dict[int, Any] = {}

    def __enter__(self) -> IterationProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, rec: OpRecord) -> None:
        it = rec.op.iteration
        if it not in self.bars:
            self.bars[it] = self.progress.add_task("", total=self.totals[it], it=it, last="")
        self.progress.update(self.bars[it], advance=1, last=rec.op.name)


def summary_table(per_it: list[dict[str, Any]], summary: dict[str, Any]) -> Table:
    agents = metric_agents(per_it)
    t = Table(title=f"flexmarl run: {summary.get('iterations', 0)} iterations, "
              f"{summary.get('wall_s', 0):.1f} s wall")
    for col in ["it", "E2E s", "tokens/s", "util", "moves", "swaps", "acc", *[f"R {a}" for a in agents]]:
        t.add_column(col, justify="right")
    for m in per_it:
        t.add_row(str(m["iteration"]), f"{m['e2e_s']:.2f}", f"{m['tokens_per_s']:.0f}",
                  f"{m['utilization']:.2f}", str(m.get("balance_moves", 0)), str(m.get("train_swaps", 0)),
                  f"{m['accuracy']:.2f}",
                  *[f"{m.get(agent_key(a, 'reward'), float('nan')):.3f}" for a in agents])
    return t
