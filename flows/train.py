"""The training flow: each iteration is a Prefect task graph mirroring the MEG, run on a Dask
cluster whose workers carry resource tags.

    flexmarl train configs/default.yaml            # CLI (starts/uses one Prefect API)
    prefect deployment run 'flexmarl-train/...'    # as a deployment (prefect.yaml)
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

from flexmarl.console import IterationProgress
from flexmarl_core import cluster
from flexmarl_core.config import load_config
from flexmarl_core.control import GradientHelper, MoveInstance, TrainSlot
from flexmarl_core.driver import run
from flexmarl_core.driver.metrics import run_summary
from flexmarl_core.driver.sft import warm_start_path
from flexmarl_core.orchestrator.hooks import Callbacks
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.runtime.location import default_cache_dir
from flexmarl_core.workloads import make_workload
from tasks import lean as lean_tasks
from tasks import report as report_tasks
from tasks.executor import PrefectDaskExecutor


@flow(name="flexmarl-train")
def train(
    config: str, overrides: list[str] | None = None, progress: bool = True, resume: bool = False
) -> dict[str, Any]:
    """Train the team described by `config` (a YAML path) with `overrides` (`a.b=c`).

    `resume`: continue the interrupted run in the config's run folder instead of starting
    afresh. A Prefect retry of a failed flow run resumes too (its run folder is kept).
    """
    log = get_run_logger()

    def say(line: str) -> None:  # the terminal's few lines (progress on), and the flow run's log
        log.info(line)
        if progress:
            # Imported here, not at module level: every task submission ships this flow in its
            # context, and a flow function pickled by value takes its globals along (the
            # console holds a lock that cannot be pickled).
            from flexmarl.console import console

            console.print(line, soft_wrap=True)

    ui = PREFECT_UI_URL.value()
    if ui:
        say(f"Prefect UI for this run: {ui}/runs/flow-run/{flow_run.get_id()}")
    cfg = load_config(config, overrides or [])
    loc = cfg.run_location()  # a local folder or a URI: what the workers are told
    resume = resume or (flow_run.run_count > 1 and loc.exists(run.CONFIG_NAME))
    if resume:
        run_dir = loc.uri
        run.check_resumable(cfg, loc)
        log.info("resuming the run in %s", run_dir)
    else:
        if cfg.train.warm_start == "sft" and not cfg.train.init_from:
            if not (warm_start_path(cfg, default_cache_dir()) / "sft.json").exists():
                say("warm start: SFT of this config's team first (a few minutes, once: later runs reuse it)")
        run_dir = report_tasks.prepare_run(cfg, echo=progress)
    scratch = loc.scratch_dir()  # this process's own files: logs, TensorBoard, pictures
    if loc.exists(run.WARM_START_NAME):
        w = json.loads(loc.read_text(run.WARM_START_NAME))
        say(f"warm start: SFT {'reused' if w['reused'] else 'made'}, held-out accuracy {w['accuracy']:.3f} "
            f"after {w['steps']} steps ({w['out_dir']})")
    log.info("run folder %s, store %s%s", run_dir, cfg.resolved_store_uri(),
             "" if loc.local else f", local scratch {scratch}")
    api = PREFECT_API_URL.value()
    lean = bool(api) and (cfg.cluster.prefect_lean is True or (
        cfg.cluster.prefect_lean == "auto" and cfg.cluster.address is None))
    env = lean_tasks.worker_env(api) if lean else {}
    with cluster.cluster_for(cfg.cluster, env=env) as client:
        if cfg.cluster.upload:  # before any task or plugin: the workers unpickle them with this code
            log.info("shipped to the workers: %s", cluster.upload_code(client, cfg.cluster.upload))
        if lean:  # code in workers that does talk to Prefect (a custom reward) reports cheaply
            lean_tasks.refresh_worker_settings(client)
        ex = PrefectDaskExecutor(client, run_dir, flow_run.get_id(), flow_run.run_count, log=log,
                                 pending_after_s=cfg.cluster.pending_after_s,
                                 flush_s=cfg.cluster.task_run_flush_s)
        log.info("Dask dashboard: %s", client.dashboard_link)
        # Dask's INFO lines go to <run>/logs, not the terminal (Prefect's stay in its API).
        cluster.log_to_files(client, scratch / "logs", workers=cfg.cluster.address is None)
        names = cluster.worker_names(client)
        workers_cpu0, cpu0 = cluster.worker_cpu_s(client), time.process_time()
        plan = Plan.build(cfg)
        bar = IterationProgress(plan) if progress else None
        try:
            with bar or contextlib.nullcontext():
                out = run.train(cfg, loc, ex, hooks=[Callbacks(bar, bar.iteration)] if bar else [],
                                resume=resume, plan=plan)
        finally:  # the final states held back, whether the run ended well or not
            ex.reporter.flush()
        flow_cpu = time.process_time() - cpu0
        workers_cpu = cluster.worker_cpu_s(client) - workers_cpu0
        names.update(cluster.worker_names(client))  # restarted workers have new addresses
    (scratch / "metrics" / "workers.json").write_text(json.dumps(names))
    if not loc.local:
        loc.upload(scratch / "metrics" / "workers.json", "metrics/workers.json")
    stage_cpu = sum(m["cpu_s"] for m in out["iterations"])
    summary = run_summary(out["iterations"], out["wall_s"])
    if cfg.train.evaluate_initial or cfg.train.evaluate:
        summary["heldout_set"] = make_workload(cfg.workload, cfg.team).heldout_description(
            cfg.workload.heldout_size)
    if cfg.train.evaluate_initial:
        ev = report_tasks.evaluate(run_dir, 0)
        summary.update({f"initial_{k}": v for k, v in ev.items() if k.startswith("heldout")})
    if cfg.train.evaluate:
        ev = report_tasks.evaluate(run_dir, cfg.train.iterations)
        summary.update({k: v for k, v in ev.items() if k.startswith("heldout")})
    # Bookkeeping = everything the workers and this flow process spent outside the stages'
    # own work (Prefect task engine, API calls, Dask). The API server's CPU is not included.
    overhead = max(workers_cpu - stage_cpu, 0.0) + flow_cpu
    summary.update(
        run_dir=str(run_dir), scratch_dir=str(scratch), ops=out["ops"], stage_cpu_s=stage_cpu, bookkeeping_cpu_s=overhead,
        flow_cpu_s=flow_cpu, worker_bookkeeping_cpu_s=max(workers_cpu - stage_cpu, 0.0),
        prefect_overhead_frac=overhead / max(overhead + stage_cpu, 1e-9),
        critical_path=out["critical_path"],
        balance_moves=sum(1 for d in out["decisions"] if isinstance(d, MoveInstance)),
        train_swaps=sum(1 for d in out["decisions"] if isinstance(d, TrainSlot) and d.swap),
        gradient_helpers=sum(1 for d in out["decisions"] if isinstance(d, GradientHelper)),
    )
    if "initial_heldout_accuracy" in summary and "heldout_accuracy" in summary:
        summary["heldout_gain"] = summary["heldout_accuracy"] - summary["initial_heldout_accuracy"]
    report_tasks.report(cfg.name, out["iterations"], summary, cfg.resolved_store_uri(),
                        [d.as_row() for d in out["decisions"]])
    try:
        summary["pictures"] = report_tasks.pictures(cfg.name, str(scratch))
    except Exception as exc:  # a picture that cannot be drawn must not fail a finished run
        log.warning("pictures of %s not drawn: %s: %s", run_dir, type(exc).__name__, exc)
        summary["pictures"] = {}
    log.info("done: %s", {k: v for k, v in summary.items() if not isinstance(v, dict)})
    return {"summary": summary, "iterations": out["iterations"]}
