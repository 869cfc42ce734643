"""The training flow: each iteration is a Prefect task graph mirroring the MEG, run on a Dask
cluster whose workers carry resource tags.

    flexmarl train configs/default.yaml            # CLI (starts/uses one Prefect API)
    prefect deployment run 'flexmarl-train/...'    # as a deployment (prefect.yaml)
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

from flexmarl.servers import ui_hint
from flexmarl_core.config import layout, load_config
from flexmarl_core.driver import run
from flexmarl_core.driver.console import RunConsole
from flexmarl_core.driver.lease import RunLease
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.runfiles import location
from tasks import leftovers, prepare, report, secrets
from tasks.executor import open_executor


@flow(name="flexmarl-train")
def train(config: str, overrides: list[str] | None = None, progress: bool = True,
          resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train the team described by `config` (a YAML path) with `overrides` (`a.b=c`).

    `resume`: continue the interrupted run in the config's run folder instead of starting
    afresh. A Prefect retry of a failed flow run resumes too (its run folder is kept).
    `overwrite`: start afresh over a run already in the run folder. The run holds the folder's
    lease while it goes (`driver/lease.py`): a second launch on it stops with the owner named.
    What earlier attempts left open in the API ends first, and this attempt's flow run is
    recorded in the run folder with how it ended (`tasks/leftovers.py`).
    """
    shown = RunConsole(progress, get_run_logger())
    me, api = str(flow_run.get_id()), PREFECT_API_URL.value()
    if PREFECT_UI_URL.value():
        shown.say(f"Prefect UI for this run: {PREFECT_UI_URL.value()}/runs/flow-run/{me}{ui_hint(api)}")
    cfg = load_config(config, overrides or [])
    if where := layout.line(cfg.cluster):
        shown.say(where)
    secrets.install()  # `${secret:..}` values resolve from this flow run's API where used
    loc = cfg.run_location()  # a local folder or a URI: what the workers are told
    resume = resume or (flow_run.run_count > 1 and loc.exists(run.CONFIG_NAME))
    held = RunLease.adopt(loc, me) or RunLease.acquire(loc, resume=resume, overwrite=overwrite, flow_run=me)
    with held as lease:
        leftovers.close_earlier(loc, api, current=me, stale=lease.taken_from)
        try:
            if resume:
                run.check_resumable(cfg, loc)
                shown.log.info("resuming the run in %s", location.shown(loc.uri))
            else:
                prepare.prepare_run(cfg, prepare.warm_start(cfg, echo=progress), echo=progress)
            leftovers.begin(loc, me, api)
            plan = Plan.build(cfg, window=run.PLAN_WINDOW)
            with open_executor(cfg, flow_run.get_id(), flow_run.run_count, get_run_logger()) as ex, \
                    shown.tracking(plan) as hooks:
                nested = [ex.iterations] if ex.iterations is not None else []
                outcome = run.train(cfg, loc, ex, hooks=[*hooks, *nested], resume=resume, plan=plan)
            summary = report.summarise(cfg, outcome, ex.api)
            ex.api.settle()  # the run's end reaches the API, or the API is given up on
        except BaseException as exc:
            leftovers.end(loc, me, exc)
            raise
        leftovers.end(loc, me, None)
        return {"summary": summary, "iterations": outcome.iterations}
