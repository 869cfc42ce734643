"""Before the first op: the warm start (SFT of the team, cached) and the run folder."""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Crashed

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.driver import run, sft
from flexmarl_core.driver.console import console
from flexmarl_core.driver.lease import Lease
from flexmarl_core.models import default_cache_dir


def _log(echo: bool) -> Any:
    logger = get_run_logger()

    def log(line: str) -> None:
        logger.info(line)
        if echo:
            console.print(f"  {line}")

    return log


@task(name="warm-start", retries=1, cache_policy=NO_CACHE, persist_result=False)
def warm_start(cfg: ExperimentConfig, echo: bool = False) -> dict[str, Any] | None:
    """CPU: the team's SFT checkpoints for `train.warm_start: sft` (made once, then reused from
    the cache); None when the run starts elsewhere. `echo`: its lines on the terminal too."""
    if cfg.train.warm_start != "sft" or cfg.train.init_from:
        return None
    log = _log(echo)
    if not (sft.warm_start_path(cfg, default_cache_dir()) / "sft.json").exists():
        log("warm start: SFT of this config's team first (a few minutes, once: later runs reuse it)")
    _, info = sft.warm_start(cfg, default_cache_dir(), log=log)
    log(f"warm start: SFT {'reused' if info['reused'] else 'made'}, held-out accuracy {info['accuracy']:.3f} "
        f"after {info['steps']} steps ({info['out_dir']})")
    return info


@task(name="prepare-run", retries=1, cache_policy=NO_CACHE, persist_result=False)
def prepare_run(cfg: ExperimentConfig, warm: dict[str, Any] | None = None, echo: bool = False) -> str:
    """CPU/IO: run folder, initial weights per agent (the warm start's, `warm`), every
    iteration's inputs in the store."""
    run_dir = str(run.prepare_run(cfg, log=_log(echo), warm=warm))
    get_run_logger().info("prepared run folder %s (store %s)", run_dir, cfg.resolved_store_uri())
    return run_dir


def mark_crashed(stale: Lease | None) -> None:
    """The flow run of a run whose lease is stale (its process died without ending the flow
    run: this run takes it over, or the audit found it) is marked Crashed, so the UI stops
    showing it Running."""
    if stale is None or stale.flow_run is None:
        return
    try:
        log: Any = get_run_logger()
    except Exception:  # outside a flow run (the audit)
        log = logging.getLogger("flexmarl")
    try:
        with get_client(sync_client=True) as client:
            old = client.read_flow_run(stale.flow_run)
            if old.state is not None and not old.state.is_final():
                client.set_flow_run_state(stale.flow_run, Crashed(message=f"its process ({stale.owner()}) ended "
                                                                          "without ending the run"), force=True)
                log.info("flow run %s of the run taken over marked Crashed", stale.flow_run)
    except Exception as exc:  # a flow run of another server, or gone: nothing to mark
        log.info("flow run %s of the run taken over not marked Crashed: %s", stale.flow_run, exc)
