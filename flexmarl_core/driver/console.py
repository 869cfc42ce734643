"""Terminal output of a run: its few lines, a progress bar per iteration and the closing
summary table."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flexmarl_core.control import Decision, Resubmit
from flexmarl_core.driver.metrics import metric_agents
from flexmarl_core.driver.telemetry import step_lines
from flexmarl_core.ops import OpRecord, agent_key
from flexmarl_core.orchestrator.hooks import Callbacks, RunHook
from flexmarl_core.orchestrator.plan import Plan

# At least 100 columns when the output is not a terminal (a log file, a pipe), where rich would
# otherwise assume 80 and cut the table.
console = Console(width=None if sys.stdout.isatty() else 100)


class RunConsole:
    """What a run shows: each line goes to `log` and, with `progress`, to the terminal, where
    a bar per iteration follows the ops while the run goes (`tracking`)."""

    def __init__(self, progress: bool, log: logging.Logger | logging.LoggerAdapter) -> None:
        self.progress, self.log = progress, log

    def say(self, line: str) -> None:
        self.log.info(line)
        if self.progress:
            console.print(line, soft_wrap=True)

    @contextlib.contextmanager
    def tracking(self, plan: Plan) -> Iterator[list[RunHook]]:
        """The run's hooks: a line when a worker is lost, and with `progress` the bars."""
        lost = LostWorkers(self.say)
        if not self.progress:
            yield [lost]
            return
        with IterationProgress(plan) as bar:
            yield [lost, Callbacks(bar, bar.iteration)]


class LostWorkers(RunHook):
    """One line when ops are run again because their worker died (Dask's own errors about it
    stay in the run's logs): once per worker, or per moment when the op had no pinned one."""

    #: resubmissions this close together are one loss
    WITHIN_S = 30.0

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self._seen = 0
        self._said: dict[str | None, float] = {}

    def op_done(self, record: OpRecord, *, decisions: list[Decision] | None = None, **kwargs: Any) -> None:
        new = (decisions or [])[self._seen:]
        self._seen += len(new)
        for d in new:
            if not isinstance(d, Resubmit):
                continue
            last = self._said.get(d.worker)
            if last is None or d.t - last > self.WITHIN_S:
                who = f"worker {d.worker}" if d.worker else "a worker"
                self.say(f"{who} lost ({d.error.split(':')[0]}); its ops run again elsewhere, from what is stored")
            self._said[d.worker] = d.t


class IterationProgress:
    """One bar per iteration, advanced as its ops complete (iterations overlap when async), and
    one line per iteration once its figures are final (`iteration`, `iteration_line`).

    Only the iterations still running and the last one finished keep a bar: rich redraws every
    bar it holds at each refresh, so with every bar kept the display's cost grew with the run
    (150 steps of `configs/overhead.yaml` at a terminal: 0.42 s per iteration with all bars
    kept, 0.24 s with these; bookkeeping 25% -> 9% of the run's CPU). Off a terminal (a log
    file, a pipe) there are no bars, only the lines: rich would show nothing until the end.
    """

    #: redraws per second (rich's default is 10); each redraws every bar shown
    REFRESH_PER_S = 4

    def __init__(self, plan: Plan, *, terminal: bool | None = None) -> None:
        terminal = console.is_terminal if terminal is None else terminal
        self.terminal = terminal
        self.progress = Progress(
            TextColumn("[bold]iteration {task.fields[n]}/{task.fields[of]}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[last]}"), TimeElapsedColumn(), console=console,
            refresh_per_second=self.REFRESH_PER_S, disable=not terminal,
        )
        self.totals = plan.sizes()
        #: iterations in the run (the lines and bars count them from 1)
        self.iterations = len(self.totals)
        self.bars: dict[int, Any] = {}
        self._done: dict[int, int] = {}
        self._last_finished: int | None = None
        self._finished: set[int] = set()

    def __enter__(self) -> IterationProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, rec: OpRecord) -> None:
        it = rec.op.iteration
        if it in self._finished:  # an op run again after its iteration ended (a lost worker)
            return
        if it not in self.bars:
            self.bars[it] = self.progress.add_task("", total=self.totals[it], it=it, n=it + 1,
                                                   of=self.iterations, last="")
            self._done[it] = 0
        self.progress.update(self.bars[it], advance=1, last=rec.op.name)
        self._done[it] += 1
        if self._done[it] == self.totals[it]:  # finished: it replaces the last finished bar
            self._finished.add(it)
            del self._done[it]
            if self._last_finished is not None:
                self.progress.remove_task(self.bars.pop(self._last_finished))
            self._last_finished = it

    def iteration(self, row: dict[str, Any]) -> None:
        """Print iteration `row`'s line (`run.train`'s `on_iteration`): above the bars at a
        terminal, as a plain line in a log or pipe."""
        it = row["iteration"]
        if row.get("rebuilt_ops") and it in self.bars and it not in self._finished:
            # a repair rewound only some of its ops: its bar ends with them, short of its total
            self._finished.add(it)
            self._done.pop(it, None)
            self.progress.remove_task(self.bars.pop(it))
        console.print(iteration_line(row, self.iterations), soft_wrap=True, highlight=False)


def iteration_line(m: dict[str, Any], iterations: int) -> str:
    """One iteration's figures in a line a user reads off a terminal or a log, e.g.

        iteration 3/20  E2E 4.21 s  acc 0.412  util 0.87  reward planner 0.500 solver 0.312

    Counted from 1 out of the run's total; E2E seconds of the iteration's window, the team's
    accuracy on its training inputs, utilisation of the workers, each agent's mean reward, and
    when there are any, its failed trajectories (they train nobody: a program raised, a reward
    ran past its deadline) and the trajectories the policy broke. A row a repair rebuilt keeps
    its first figures and says so."""
    rewards = " ".join(f"{a} {m[agent_key(a, 'reward')]:.3f}" for a in metric_agents([m]))
    return (f"iteration {m['iteration'] + 1}/{iterations}  E2E {m['e2e_s']:.2f} s  "
            f"acc {m['accuracy']:.3f}  util {m['utilization']:.2f}"
            + (f"  reward {rewards}" if rewards else "")
            + (f"  failed trajectories {m['failed_trajectories']:.0f}" if m.get("failed_trajectories") else "")
            + (f"  policy-broken {m['team/program/policy_failed']:.0f}" if m.get("team/program/policy_failed") else "")
            + (f"  ({m['downtime_s']:.0f} s down before the resume left out)" if m.get("downtime_s") else "")
            + (f"  (rebuilt after a store repair: {m['rebuilt_ops']} ops ran again; the figures are the "
               "first run's)" if m.get("rebuilt_ops") else ""))


def summary_table(per_it: list[dict[str, Any]], summary: dict[str, Any]) -> Table:
    """One row per iteration; under 100 columns for a team of a few agents (agent names are
    column headers in full, values are 3 decimals)."""
    agents = metric_agents(per_it)
    failed = any(m.get("failed_trajectories") for m in per_it)  # a column only when some failed
    t = Table(title=f"flexmarl run: {summary.get('iterations', 0)} iterations, "
              f"{summary.get('wall_s', 0):.1f} s wall", padding=(0, 1))
    for col in ["it", "E2E s", "tok/s", "util", "moves", "swaps", "acc", *(["failed"] if failed else [])]:
        t.add_column(col, justify="right")
    for a in agents:
        t.add_column(f"R {a}", justify="right", no_wrap=True, min_width=len(a) + 2)
    for m in per_it:
        t.add_row(str(m["iteration"] + 1), f"{m['e2e_s']:.2f}", f"{m['tokens_per_s']:.0f}",
                  f"{m['utilization']:.2f}", str(m.get("balance_moves", 0)), str(m.get("train_swaps", 0)),
                  f"{m['accuracy']:.2f}", *([f"{m.get('failed_trajectories', 0):.0f}"] if failed else []),
                  *[f"{m.get(agent_key(a, 'reward'), float('nan')):.3f}" for a in agents])
    return t


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The closing lines: held-out accuracy before and after RL, speed, where things are."""
    lines = []
    if "heldout_set" in s:
        lines.append(f"held-out set: {s['heldout_set']}")
    if "heldout_accuracy" in s:
        if "initial_heldout_accuracy" in s:
            lines.append(f"held-out team accuracy: {s['initial_heldout_accuracy']:.3f} before RL -> "
                         f"{s['heldout_accuracy']:.3f} after ({s['heldout_gain']:+.3f})")
        else:
            lines.append(f"held-out team accuracy: {s['heldout_accuracy']:.3f} after training")
    if s.get("final_reward"):
        lines.append("final reward per agent: " + ", ".join(f"{a} {v:.3f}" for a, v in s["final_reward"].items()))
    if s.get("failed_trajectories"):
        lines.append(f"failed trajectories: {s['failed_trajectories']} (they train nobody; the iterations' "
                     "reward and program manifests name them)")
    if "attempt_wall_s" in s:
        lines.append(f"resumed: {s['wall_s']:.1f} s of running in all, {s['attempt_wall_s']:.1f} s of them in "
                     "this attempt (the downtime between is left out)")
    lines += step_lines(s.get("where_a_step_goes", {}))
    lines.append(
        f"E2E {s['e2e_s_per_iteration']:.2f} s/iteration, {s['tokens_per_s']:.0f} tokens/s, "
        f"utilisation {s['utilization']:.2f}, Prefect+Dask bookkeeping {100 * s['prefect_overhead_frac']:.1f}% of CPU")
    pics = s.get("pictures", {})
    local = s.get("scratch_dir", s["run_dir"])  # a run on object storage keeps these locally
    if local != s["run_dir"]:
        lines.append(f"run files (config, weights, checkpoints, op log) in {s['run_dir']}")
    lines.append(f"metrics, logs and pictures ({', '.join(Path(p).name for p in pics.values())}) in {local}")
    if (Path(local) / "metrics" / "tensorboard").is_dir():  # none when TensorBoard could not load
        lines.append(f"live scalars: tensorboard --logdir {local}/metrics/tensorboard")
    return lines
