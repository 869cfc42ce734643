"""The simulator's Prefect task: one point of a what-if sweep (`flows/simulate.py`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl_core.config import load_config
from flexmarl_core.sim.cluster import load_cluster
from flexmarl_core.sim.study import modes, run_cluster, split_overrides


@task(name="simulate-point", retries=0, cache_policy=NO_CACHE, persist_result=False)
def simulate_point(config: str, cluster: str, overrides: list[str], mode: str) -> dict[str, Any]:
    """CPU: one simulated run (one mode at one point; deterministic, so no retries); returns
    its summary, every figure simulated."""
    cfg_over, sim_over = split_overrides(overrides)
    cfg = load_config(config, [*cfg_over, *modes()[mode]])
    summary = run_cluster(cfg, load_cluster(cluster, sim_over)).summary
    return {"overrides": overrides, "mode": mode, **summary}
