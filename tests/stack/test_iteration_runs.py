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


def test_reports_wait_for_their_iterations_flow_run_and_a_failed_flow_fails_the_open_ones(prefect_api):
    """On the real API: an op of an iteration whose nested flow run is still being made is
    reported once it exists (in order, into it); the iteration that ended is Completed (one whose ops
    all ran in an earlier attempt too, in a run of its own), the one still open when the flow
    stops is Failed with the error; `flush(final=True)` puts a report
    whose flow run never came into the training run's own."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from flexmarl_core.ops import Op, StageResult
    from tasks.iteration_runs import IterationFlowRuns
    from tasks.task_runs import TaskRunReporter

    a, b, orphan = Op(0, "reward", mb=0), Op(1, "reward", mb=0), Op(7, "reward", mb=0)

    @flow
    def reports() -> dict:
        with get_client(sync_client=True) as client:
            its = IterationFlowRuns(client, flow_run.get_id())
            made = {0, 1}  # iteration 7's flow run is never made (an API that never came back)
            r = TaskRunReporter(flow_run.get_id(), 1, pending_after_s=0.0, flush_s=0.0,
                                flow_run_of=lambda i: its.flow_run_id(i) if i in made else None)
            deferred_at_first = its.flow_run_id(0) is None  # asked for, being made on its thread
            for op in (a, b, orphan):
                r.submitted(op, [], 100.0)
                r.finished(op, StageResult(op, t_start=100.0, t_end=100.5))
            deadline = time.monotonic() + 30
            while len(r._deferred) > 2 and time.monotonic() < deadline:  # orphan's two reports stay
                r.report_due(101.0)
                time.sleep(0.05)
            its.iteration_done({"iteration": 0})
            its.iteration_done({"iteration": 5})  # its ops ran in an earlier attempt (a resume)
            its.close(RuntimeError("stage broke"))
            r.flush(final=True)
            return {"deferred_at_first": deferred_at_first, "left": len(r._deferred)}

    state = reports(return_state=True)
    out = state.result()
    assert out["deferred_at_first"] and out["left"] == 0
    own, kids, ops = children_of(state.state_details.flow_run_id, 3)
    by_name = {k.name: k for k in kids.values()}
    assert by_name["iteration 0"].state.is_completed()
    # An iteration final in this attempt whose ops all ran before has a Completed run, empty.
    assert by_name["iteration 5"].state.is_completed() and not ops.get(by_name["iteration 5"].id)
    assert by_name["iteration 1"].state.is_failed() and "stage broke" in by_name["iteration 1"].state.message
    assert [r.name for r in ops[by_name["iteration 0"].id]] == [a.name]
    assert [r.name for r in ops[by_name["iteration 1"].id]] == [b.name]
    deadline = time.monotonic() + 30
    while orphan.name not in {r.name for r in own} and time.monotonic() < deadline:
        time.sleep(0.5)
        own, _, _ = asyncio.run(nested(state.state_details.flow_run_id))
    assert orphan.name in {r.name for r in own}
