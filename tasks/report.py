"""A run's report: its held-out evaluation, its summary and the artifacts it publishes.

A training run publishes four artifacts (keys from the run's name, e.g. `arith-tiny-...`):
`-iterations` (table: E2E time, tokens/s, utilisation, reward/accuracy and training
statistics per agent, balancing and swap figures per iteration), `-decisions` (table: every
control-plane decision), `-summary` (markdown: store, run folder, text charts of reward and
throughput, run figures) and `-pictures` (markdown: the run's timeline and learning curves as
embedded PNGs, data URIs, which the Prefect UI's markdown shows inline). Artifacts and logs
name the run folder as `runfiles.location.shown` does (relative, never this machine's
absolute path) and its files relative to it. Each task run has a stable name (`evaluate it 20`,
`report`), not Prefect's random suffix.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path
from typing import Any

import httpx
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_API_URL

from flexmarl_core import stages
from flexmarl_core.config import ExperimentConfig
from flexmarl_core.driver.metrics import metric_agents
from flexmarl_core.driver.plots import report as draw
from flexmarl_core.driver.run import RunOutcome
from flexmarl_core.ops import agent_key
from flexmarl_core.runfiles.location import shown
from flexmarl_core.workloads import make_workload
from tasks.api_watch import ApiWatch

#: per-iteration columns shown first, in this order; other metrics (stage_s/*, busy_s/*) follow
ITERATION_LEAD = ["iteration", "e2e_s", "tokens", "tokens_per_s", "utilization", "accuracy"]
ITERATION_AFTER_REWARDS = ["balance_moves", "train_swaps", "swap_in_bytes", "swap_out_bytes",
                           "swap_in_s", "swap_out_s"]
#: decision columns, whichever kinds of decision a run made (a column is empty where n/a)
DECISION_COLUMNS = ["t", "decision", "iteration", "agent", "worker", "from_agent", "to_agent",
                    "swap", "state_was_on", "cost_bytes", "loads", "op", "error"]
SPARK = "▁▂▃▄▅▆▇█"


def artifact_key(name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in name.lower())


@task(name="evaluate", task_run_name="evaluate it {iteration}", retries=1, cache_policy=NO_CACHE,
      persist_result=False)
def evaluate(run_dir: str, iteration: int) -> dict[str, Any]:
    """CPU: greedy held-out accuracy of the team with the weights of `iteration`."""
    res = stages.evaluate(run_dir, iteration)
    get_run_logger().info("held-out accuracy with the weights of iteration %d: %.4g on %d problems",
                          iteration, res["heldout_accuracy"], res["heldout_n"])
    return res


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, dict | list | tuple):  # table cells are scalars: nested values as JSON text
        return json.dumps(v, default=str, separators=(", ", ": "))
    return v


def iteration_rows(per_it: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows with the headline columns first; every row has the same keys."""
    keys: list[str] = []
    for m in per_it:
        keys += [k for k in m if k not in keys]
    rewards = [agent_key(a, "reward") for a in metric_agents(per_it)]
    order = [k for k in ITERATION_LEAD if k in keys] + rewards + [k for k in ITERATION_AFTER_REWARDS if k in keys]
    order += [k for k in keys if k not in order]
    return [{k: _cell(m.get(k)) for k in order} for m in per_it]


def decision_table(decisions: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Column-oriented, so the columns exist even for a run that made no decision (the
    synchronous baseline); `t` as UTC ISO time, decision kinds' own extra keys appended."""
    extra = sorted({k for d in decisions for k in d} - set(DECISION_COLUMNS))
    cols: dict[str, list[Any]] = {k: [] for k in [*DECISION_COLUMNS, *extra]}
    for d in sorted(decisions, key=lambda d: d.get("t", 0.0)):
        for k, col in cols.items():
            v = d.get(k)
            if k == "t" and isinstance(v, int | float):
                v = dt.datetime.fromtimestamp(v, dt.UTC).isoformat(timespec="milliseconds")
            col.append(_cell(v))
    return cols


def sparkline(values: list[float], lo: float, hi: float) -> str:
    """One block character per value on the scale lo..hi (a flat series sits mid-height)."""
    if hi - lo <= 1e-12:
        return SPARK[len(SPARK) // 2] * len(values)
    return "".join(SPARK[min(int((v - lo) / (hi - lo) * len(SPARK)), len(SPARK) - 1)] for v in values)


def text_charts(per_it: list[dict[str, Any]], width: int = 40, max_bar_rows: int = 40) -> str:
    """Reward per agent (and team accuracy) as sparklines on one shared scale, and tokens/s as
    one bar per iteration (a sparkline beyond `max_bar_rows` iterations), axes labelled."""
    if not per_it:
        return "(no iterations)"
    its = [m["iteration"] for m in per_it]
    agents = metric_agents(per_it)
    series = {a: [float(m.get(agent_key(a, "reward"), 0.0)) for m in per_it] for a in agents}
    series["accuracy"] = [float(m.get("accuracy", 0.0)) for m in per_it]
    lo = min(min(v) for v in series.values())
    hi = max(max(v) for v in series.values())
    label = max(len(a) for a in series)
    out = [f"reward per agent and team accuracy, iterations {its[0]}..{its[-1]} (shared scale {lo:.3f} ▁ .. █ {hi:.3f})", ""]
    for a, vals in series.items():
        out.append(f"{a:<{label}}  {sparkline(vals, lo, hi)}  {vals[0]:.3f} -> {vals[-1]:.3f}")
    tps = [float(m.get("tokens_per_s", 0.0)) for m in per_it]
    top = max(max(tps), 1e-9)
    out += ["", f"throughput (tokens/s) per iteration, mean {sum(tps) / len(tps):,.1f}", ""]
    if len(per_it) > max_bar_rows:
        out.append(f"tokens/s  {sparkline(tps, 0.0, top)}  0 ▁ .. █ {top:,.1f}")
        return "\n".join(out)
    w = len(str(its[-1]))
    for it, v in zip(its, tps, strict=True):
        n = round(v / top * width)
        out.append(f"it {it:>{w}} │{'█' * n}{' ' * (width - n)} {v:,.1f}")
    out.append(f"{' ' * (w + 3)} └{'─' * width}")
    out.append(f"{' ' * (w + 5)}0{f'{top:,.1f} tokens/s':>{width - 1}}")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else f"`{v}`" if isinstance(v, str) else str(v)


#: summary entries that are paths on the machine that ran: shown relative (`shown`)
_PATHS = ("run_dir", "scratch_dir")


def summary_markdown(name: str, per_it: list[dict[str, Any]], summary: dict[str, Any], store_uri: str) -> str:
    run_dir = summary.get("run_dir", "")
    lines = [f"# {name}", "", f"- store: `{shown(store_uri)}`", f"- run folder: `{shown(run_dir)}`", ""]
    if summary.get("scratch_dir", run_dir) != run_dir:
        lines[-1:-1] = [f"- this machine's copy of its metrics and pictures: `{shown(summary['scratch_dir'])}`"]
    lines += ["## Reward and throughput", "", "```text", text_charts(per_it), "```", "", "## Run figures", ""]
    for k, v in summary.items():
        if k in _PATHS:
            continue
        if k == "pictures" and isinstance(v, dict):
            v = {kind: shown(p, summary.get("scratch_dir", run_dir)) for kind, p in v.items()}
        if isinstance(v, dict):  # e.g. critical_path, final_reward: one sub-item per entry
            lines.append(f"- {k}:" + ("" if v else " (none)"))
            lines += [f"  - {sk}: {_fmt(sv)}" for sk, sv in v.items()]
        else:
            lines.append(f"- {k}: {_fmt(v)}")
    return "\n".join(lines)


@task(name="report", task_run_name="report", cache_policy=NO_CACHE, persist_result=False)
def report(
    name: str, per_it: list[dict[str, Any]], summary: dict[str, Any], store_uri: str,
    decisions: list[dict[str, Any]] | None = None,
) -> dict[str, str]:
    """IO: the run's table and summary artifacts (module docstring); returns their keys by kind."""
    key = artifact_key(name)
    keys = {k: f"{key}-{k}" for k in ("iterations", "decisions", "summary")}
    create_table_artifact(key=keys["iterations"], table=iteration_rows(per_it),
                          description=f"{name}: per-iteration metrics")
    create_table_artifact(key=keys["decisions"], table=decision_table(decisions or []),
                          description=f"{name}: control-plane decisions (instance moves, training slots, resubmits)")
    create_markdown_artifact(key=keys["summary"], markdown=summary_markdown(name, per_it, summary, store_uri),
                             description=f"{name}: run summary")
    get_run_logger().info("artifacts %s published for run folder %s (store %s, %d decisions)",
                          ", ".join(keys.values()), shown(summary.get("run_dir", "")), shown(store_uri),
                          len(decisions or []))
    return keys


#: pictures up to this size are embedded in the artifact; larger ones are linked by path
EMBED_MAX_BYTES = 400_000


@task(name="pictures", task_run_name="pictures", cache_policy=NO_CACHE, persist_result=False)
def pictures(name: str, run_dir: str) -> dict[str, str]:
    """CPU/IO: `timeline.png` and `curves.png` in the run folder, and a `-pictures` artifact
    that shows them."""
    paths = draw(run_dir)
    lines = [f"# {name}: pictures", "", f"Run folder `{shown(run_dir)}`.", ""]
    for kind, path in paths.items():
        data = path.read_bytes()
        lines.append(f"## {kind}  (`{shown(path, run_dir)}` in the run folder)")
        if len(data) <= EMBED_MAX_BYTES:
            lines.append(f"![{kind}](data:image/png;base64,{base64.b64encode(data).decode()})")
        lines.append("")
    create_markdown_artifact(key=f"{artifact_key(name)}-pictures", markdown="\n".join(lines),
                             description=f"{name}: timeline of ops per worker, and learning curves")
    return {k: str(v) for k, v in paths.items()}


@task(name="evaluation-report", task_run_name="evaluation-report", cache_policy=NO_CACHE, persist_result=False)
def evaluation_report(name: str, run_dir: str, result: dict[str, Any]) -> None:
    """IO: a markdown artifact with a run's held-out evaluation (accuracy, reward per agent)."""
    key = artifact_key(name)
    lines = [f"# {name}: held-out evaluation, iteration {result['iteration']}", "",
             f"- run folder: `{shown(run_dir)}`",
             f"- accuracy: {result['heldout_accuracy']:.4g} on {result['heldout_n']} problems"]
    lines += [f"- {k}: {v:.4g}" for k, v in sorted(result.items()) if k.startswith("heldout_reward/")]
    create_markdown_artifact(key=f"{key}-evaluation", markdown="\n".join(lines),
                             description=f"{name}: held-out evaluation")
    get_run_logger().info("artifact %s-evaluation published for %s", key, shown(run_dir))


def summarise(cfg: ExperimentConfig, outcome: RunOutcome, api: ApiWatch | None = None) -> dict[str, Any]:
    """A trained run's summary (`RunOutcome.summary`) with its held-out accuracy before and
    after (the `evaluate` tasks, as the config asks), published with its artifacts and
    pictures (a picture that cannot be drawn does not fail a finished run), and written to
    the run's metrics (`SUMMARY_NAME`), where the CLI finds it if the flow cannot report its
    end. With the Prefect API gone, the same figures are made without task runs or artifacts
    (each would wait out the client's retries first): `api`, the run's watch on it, waits for
    it within the run's budget (`tasks/api_watch.py`); without one, it is asked once."""
    online = api.settle() if api is not None else _api_answers()
    summary = outcome.summary()
    summary["prefect_api"] = "reachable" if online else "unreachable"
    evaluated = evaluate if online else evaluate.fn
    if cfg.train.evaluate_initial or cfg.train.evaluate:
        summary["heldout_set"] = make_workload(cfg.workload, cfg.team).heldout_description(cfg.workload.heldout_size)
    if cfg.train.evaluate_initial:
        ev = evaluated(outcome.run_dir, 0)
        summary.update({f"initial_{k}": v for k, v in ev.items() if k.startswith("heldout")})
    if cfg.train.evaluate:
        ev = evaluated(outcome.run_dir, cfg.train.iterations)
        summary.update({k: v for k, v in ev.items() if k.startswith("heldout")})
    if "initial_heldout_accuracy" in summary and "heldout_accuracy" in summary:
        summary["heldout_gain"] = summary["heldout_accuracy"] - summary["initial_heldout_accuracy"]
    if online:
        report(cfg.name, outcome.iterations, summary, cfg.resolved_store_uri(), [d.as_row() for d in outcome.decisions])
    try:
        summary["pictures"] = (pictures(cfg.name, outcome.scratch_dir) if online else
                               {k: str(v) for k, v in draw(outcome.scratch_dir).items()})
    except Exception as exc:
        get_run_logger().warning("pictures of %s not drawn: %s: %s", shown(outcome.run_dir), type(exc).__name__, exc)
        summary["pictures"] = {}
    get_run_logger().info("done: %s", {k: shown(v) if k in _PATHS else v for k, v in summary.items()
                                       if not isinstance(v, dict)})
    out = Path(outcome.scratch_dir) / "metrics" / SUMMARY_NAME
    out.write_text(json.dumps({"summary": summary, "iterations": outcome.iterations}, default=str))
    return summary


#: a finished run's summary and iteration rows, in its (scratch) metrics folder
SUMMARY_NAME = "summary.json"


def _api_answers() -> bool:
    """Whether the run's Prefect API answers now (none configured: nothing to lose)."""
    api = PREFECT_API_URL.value()
    if not api:
        return True
    try:
        return httpx.get(api.rstrip("/") + "/health", timeout=5.0).status_code < 500
    except httpx.HTTPError:
        return False
