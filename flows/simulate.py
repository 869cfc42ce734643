"""The what-if sweep: simulated points (cluster sizes or co-design switches) as Prefect tasks on
a local Dask cluster, one point per task.

    flexmarl simulate CONFIG --cluster CLUSTER.yaml --sweep sim.inference.nodes=8,16,32
    flexmarl simulate CONFIG --cluster CLUSTER.yaml --sweep switches

A `KEY=V1,V2` sweep runs the synchronous baseline and the co-design at each value; `switches`
runs the co-design, the baseline and each switch off alone. Every figure is simulated.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect_dask import DaskTaskRunner

from flexmarl_core.config import ConfigError
from flexmarl_core.sim import LABEL
from flexmarl_core.sim.study import CODESIGN, SYNC, modes
from tasks.simulate import simulate_point


def points(sweep: str) -> list[tuple[list[str], str]]:
    """(extra overrides, mode) of every point of `sweep`."""
    if sweep == "switches":
        return [([], m) for m in modes()]
    key, _, values = sweep.partition("=")
    if not key or not values:
        raise ConfigError(f"--sweep {sweep!r}: give KEY=V1,V2,... or `switches`")
    return [([f"{key}={v}"], m) for v in values.split(",") for m in (SYNC, CODESIGN)]


@flow(name="flexmarl-simulate-sweep",
      # TLS with certificates made for the sweep, the dashboard on loopback: as every cluster flexmarl starts
      task_runner=DaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 1, "security": True,
                                                 "dashboard_address": "127.0.0.1:0"}))
def sweep(config: str, cluster: str, sweep: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Every point a `simulate-point` task on the flow's Dask cluster; their summaries."""
    futures = [simulate_point.submit(config, cluster, [*(overrides or []), *extra], mode)
               for extra, mode in points(sweep)]
    rows = [f.result() for f in futures]
    return {"label": LABEL, "sweep": sweep, "points": rows}
