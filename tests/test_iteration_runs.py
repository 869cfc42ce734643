"""Each iteration of a training run is a flow run of its own nested under the run's
(`tasks/iteration_runs.py`): the Prefect UI draws a graph per iteration, whatever the run's
length, and the training run's flow run lists the iterations."""

from __future__ import annotations

import asyncio
import re
import time

from tests._runs import ITERATIONS


async def nested(flow_run_id) -> tuple[list, dict, dict]:
    """The training flow run's iteration task runs, its nested flow runs, and each nested flow
    run's task runs."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
    )

    async with get_client() as c:
        own = await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
        children = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        ops = {ch.id: await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[ch.id])), limit=200)
               for ch in children}
    return own, {ch.id: ch for ch in children}, ops


def children_of(flow_run_id, want: int, patience_s: float = 30.0) -> tuple[list, dict, dict]:
    """`nested`, once `want` nested flow runs are final (states are set on a thread of the flow)."""
    deadline = time.monotonic() + patience_s
    while True:
        own, kids, ops = asyncio.run(nested(flow_run_id))
        if sum(k.state.is_final() for k in kids.values()) >= want or time.monotonic() > deadline:
            return own, kids, ops
        time.sleep(0.5)


def test_each_iteration_is_a_nested_flow_run_holding_its_ops(baseline_run, prefect_api):
    cfg, flow_run_id = baseline_run
    own, kids, ops = children_of(flow_run_id, ITERATIONS)
    tracking = {r.name: r for r in own if r.name.startswith("iteration ")}
    assert sorted(tracking) == [f"iteration {i}" for i in range(ITERATIONS)]
    # No op task run is left in the training run's own graph.
    assert not [r.name for r in own if re.match(r"(rollout|reward|train|step|sync)\b", r.name)]
    assert sorted(k.name for k in kids.values()) == sorted(tracking)
    for kid in kids.values():
        assert kid.state.is_completed(), (kid.name, kid.state)
        parent = tracking[kid.name]
        assert kid.parent_task_run_id == parent.id and parent.state.is_completed(), kid.name
        it = int(kid.name.split()[1])
        names = [r.name for r in ops[kid.id]]
        assert names and all(f" it={it}" in n for n in names), (kid.name, names)
        assert all(r.state.is_completed() for r in ops[kid.id])
    # The parent's graph chains the iterations: each one's upstream input is the one before.
    for i in range(1, ITERATIONS):
        ups = [x.id for xs in tracking[f"iteration {i}"].task_inputs.values() for x in xs]
        assert ups == [tracking[f"iteration {i - 1}"].id]
    # Every op of the plan has its task run, in its iteration's flow run.
    from flexmarl_core.orchestrator.plan import Plan

    assert sum(len(v) for v in ops.values()) == len(Plan.build(cfg).deps)
