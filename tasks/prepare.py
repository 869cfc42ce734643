"""Before the first op: the warm start (SFT of the team, cached) and the run folder."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.driver import run, sft
from flexmarl_core.driver.console import console
from flexmarl_core.models import default_cache_dir
from flexmarl_core.runfiles.location import shown


def _log(echo: bool) -> Any:
    logger = get_run_logger()

    def log(line: str) -> None:
        logger.info(line)
        if echo:
            console.print(f"  {line}")

    return log


@task(name="warm-start", task_run_name="warm-start", retries=1, cache_policy=NO_CACHE, persist_result=False)
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


@task(name="prepare-run", task_run_name="prepare-run", retries=1, cache_policy=NO_CACHE, persist_result=False)
def prepare_run(cfg: ExperimentConfig, warm: dict[str, Any] | None = None, echo: bool = False) -> str:
    """CPU/IO: run folder, initial weights per agent (the warm start's, `warm`), every
    iteration's inputs in the store."""
    run_dir = str(run.prepare_run(cfg, log=_log(echo), warm=warm))
    get_run_logger().info("prepared run folder %s (store %s)", shown(run_dir), shown(cfg.resolved_store_uri()))
    return run_dir

