"""The what-if sweep: simulated points (cluster sizes or co-design switches) as Prefect tasks on
a local Dask cluster, one point per task.

    flexmarl simulate CONFIG --cluster CLUSTER.yaml --sweep sim.inference.nodes=8,16,32
    flexmarl simulate CONFIG --cluster CLUSTER.yaml --sweep switches

A `KEY=V1,V2` sweep runs the synchronous baseline and the co-design at each value; `switches`
runs the co-design, the baseline and each switch off alone. Every figure is simulated.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect_dask import DaskTaskRunner

from flexmarl_core.config import ConfigError, load_config
from flexmarl_core.sim import LABEL
from flexmarl_core.sim.cluster import load_cluster
from flexmarl_core.sim.study import CODESIGN, SYNC, modes, run_cluster, split_overrides


@task(name="simulate-point", cache_policy=NO_CACHE, persist_result=False)
def simulate_point(config: str, cluster: str, overrides: list[str], mode: str) -> dict[str, Any]:
    """CPU work: one simulated run (one mode at one point); returns its summary."""
    cfg_over, sim_over = split_overrides(overrides)
    cfg = load_config(config, [*cfg_over, *modes()[mode]])
    summary = run_cluster(cfg, load_cluster(cluster, sim_over)).summary
    return {"overrides": overrides, "mode": mode, **summary}


def points(sweep: str) -> list[tuple[list[str], str]]:
    if sweep == "switches":
        return [([], m) for m in modes()]
    key, _, values = sweep.partition("=")
    if not key or not values:
        raise ConfigError(f"--sweep {sweep!r}: give KEY=V1,V2,... or `switches`")
    return [([f"{key}={v}"], m) for v in values.split(",") for m in (SYNC, CODESIGN)]


@flow(name="flexmarl-simulate-sweep",
      task_runner=DaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 1}))
def sweep(config: str, cluster: str, sweep: str, overrides: list[str] | None = None) -> dict[str, Any]:
    futures = [simulate_point.submit(config, cluster, [*(overrides or []), *extra], mode)
               for extra, mode in points(sweep)]
    rows = [f.result() for f in futures]
    return {"label": LABEL, "sweep": sweep, "points": rows}
