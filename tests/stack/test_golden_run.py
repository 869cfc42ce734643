"""The renovation changed nothing that a run produces, and the Prefect UI draws the MEG.

`tests/golden/default.json` was recorded from the default config (2 iterations, a team reward
that varies for untrained models) before the op path was rebuilt around typed ops; the same
run through today's Prefect flow on the session's Dask cluster must give the same samples
(token for token) and the same final weights (`tests/_golden.py` says how they are compared).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.orchestrator.plan import Plan
from tests import _golden

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "configs" / "default.yaml")
GOLDEN = REPO / "tests" / "golden" / "default.json"
# The golden run predates the default config's warm start: it starts from random weights.
RECORDED = ["train.iterations=2", "workload.reward=tests.reward_fns:varied", "workload.credit=team",
            "train.warm_start=none", "train.evaluate_initial=false", "workload.heldout_size=128",
            "batch.inputs_per_iteration=64", "batch.micro_batch_inputs=32"]


@pytest.fixture(scope="module")
def golden_run(prefect_api, dask_cluster, tmp_path_factory):
    from flows.train import train

    run_dir = tmp_path_factory.mktemp("golden") / "run"
    overrides = [*RECORDED, f"run_dir={run_dir}", f"cluster.address={dask_cluster}", "cluster.prefect_lean=true"]
    state = train(DEFAULT, overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message
    return run_dir, overrides, state


def test_same_samples_and_weights_as_the_golden_run(golden_run):
    run_dir, _, _ = golden_run
    # Projections of float32 weights of magnitude ~0.1-1 onto unit vectors: 1e-6 is a few
    # float32 ulps of the projection, far below what a changed update would move.
    bad = _golden.compare(_golden.fingerprint(run_dir), json.loads(GOLDEN.read_text()), atol=1e-6)
    assert not bad, "\n".join(bad[:20])


async def _task_runs(flow_run_id, want: int, patience_s: float = 30.0):
    """Every task run of the flow run, once the API has recorded `want` of them (the server
    records task runs from events in batches, so the last ones can lag the flow's end)."""
    from prefect import get_client

    from tests._runs import read_op_task_runs

    runs: list = []
    async with get_client() as c:
        for _ in range(int(patience_s / 0.5)):
            runs = await read_op_task_runs(c, flow_run_id)
            if len(runs) >= want:
                break
            await asyncio.sleep(0.5)
    return runs


def test_prefect_graph_has_the_megs_edges(golden_run):
    """Every stage task run lists the task runs of the ops it waited for as upstream inputs:
    the flow run's graph in the UI is the plan's dependency graph, edge for edge."""
    _, overrides, state = golden_run
    cfg = load_config(DEFAULT, overrides)
    plan = Plan.build(cfg)
    runs = asyncio.run(_task_runs(state.state_details.flow_run_id, len(plan.deps)))
    by_name = {r.name: r for r in runs if r.name.split("[")[0].split(" ")[0] in ("rollout", "reward", "train", "step", "sync")}
    assert set(by_name) == {op.name for op in plan.ops()}
    id_to_name = {r.id: n for n, r in by_name.items()}
    for op, deps in plan.deps.items():
        upstream = {id_to_name[i.id] for inputs in by_name[op.name].task_inputs.values() for i in inputs
                    if getattr(i, "id", None) in id_to_name}
        assert upstream == {d.name for d in deps}, op.name
