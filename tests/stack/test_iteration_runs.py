"""Each iteration of a training run is a flow run of its own nested under the run's
(`tasks/iteration_runs.py`): the Prefect UI draws a graph per iteration, whatever the run's
length, and the training run's flow run lists the iterations."""

from __future__ import annotations

import asyncio
import json
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


async def records(flow_run_ids) -> tuple[dict, dict]:
    """Each flow run's log messages and artifacts."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    async with get_client() as c:
        logs = {i: [x.message for x in await c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[i])))]
                for i in flow_run_ids}
        arts = {i: await c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[i])))
                for i in flow_run_ids}
    return logs, arts


def test_each_iteration_is_a_nested_flow_run_holding_its_ops(baseline_run, prefect_api):
    cfg, flow_run_id = baseline_run
    own, kids, ops = children_of(flow_run_id, ITERATIONS)
    from tasks.iteration_runs import TRACKING_KEY

    tracking = {r.name: r for r in own if r.task_key == TRACKING_KEY}
    # Named after the run, and tagged with its name: the runs list says whose they are.
    assert sorted(tracking) == [f"{cfg.name} it {i}" for i in range(ITERATIONS)]
    # No op task run is left in the training run's own graph; its other tasks have stable names.
    assert not [r.name for r in own if re.match(r"(rollout|reward|train|step|sync)\b", r.name)]
    others = sorted(r.name for r in own if r.task_key != TRACKING_KEY)
    assert others and all(not re.search(r"-[0-9a-f]{3}$", n) for n in others), others
    assert sorted(k.name for k in kids.values()) == sorted(tracking)
    for kid in kids.values():
        assert kid.state.is_completed(), (kid.name, kid.state)
        assert cfg.name in kid.tags and cfg.name in tracking[kid.name].tags, (kid.tags, tracking[kid.name].tags)
        parent = tracking[kid.name]
        assert kid.parent_task_run_id == parent.id and parent.state.is_completed(), kid.name
        it = int(kid.name.split()[-1])
        names = [r.name for r in ops[kid.id]]
        assert names and all(f" it={it}" in n for n in names), (kid.name, names)
        assert all(r.state.is_completed() for r in ops[kid.id])
    # The parent's graph chains the iterations: each one's upstream input is the one before.
    for i in range(1, ITERATIONS):
        ups = [x.id for xs in tracking[f"{cfg.name} it {i}"].task_inputs.values() for x in xs]
        assert ups == [tracking[f"{cfg.name} it {i - 1}"].id]
    # Every op of the plan has its task run, in its iteration's flow run.
    from flexmarl_core.orchestrator.plan import Plan

    assert sum(len(v) for v in ops.values()) == len(Plan.build(cfg).deps)
    # Each iteration's own record: its line and decisions in its logs, an artifact of its ops;
    # iteration 1 names the ops of iteration 0 it waited for (edges Prefect does not draw).
    logs, arts = asyncio.run(records(list(kids)))
    by_it = {int(k.name.split()[-1]): k.id for k in kids.values()}
    for it, kid in by_it.items():
        assert any(m.startswith(f"iteration {it + 1}/{ITERATIONS}  E2E") for m in logs[kid]), logs[kid]
        # tiny.yaml allocates training on demand: a training slot per trainable agent and iteration
        assert sum(m.startswith("train_slot: ") for m in logs[kid]) == 3, logs[kid]
        (art,) = arts[kid]
        assert art.type == "markdown" and all(n in art.data for n in (r.name for r in ops[kid])), art.data
    waited = [m for m in logs[by_it[1]] if m.startswith("waited on")]
    assert waited and "sync[solver] it=0" in waited[0] and f"{cfg.name} it 0" in waited[0], logs[by_it[1]]
    assert "sync[solver] it=0" in kids[by_it[1]].state.message
    assert not [m for m in logs[by_it[0]] if m.startswith("waited on")]


def test_a_failed_run_leaves_no_flow_or_task_run_open(prefect_api, dask_cluster, tmp_path):
    """An op fails for good while another is in flight (held, reported Pending): the training
    run fails, and every flow run and task run under it is final, the open ones Failed with the
    run's error as the reason."""
    from flexmarl_core.stages.faults import release
    from tests._runs import COMMON, flow, open_runs_under, plant_fault

    run_dir = tmp_path / "run"
    held, broken = "rollout[planner] it=0 mb=1", "rollout[solver] it=0 mb=0"
    plant_fault(run_dir, "fail", broken, "3")  # 1 try + 2 retries, all fail
    (run_dir.parent / "run.faults" / f"hold@{held}").write_text("300")
    try:
        state = flow([f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *COMMON, "cluster.pending_after_s=0"])
    finally:
        release(run_dir, held)  # the shared cluster's worker goes back to work
    assert state.is_failed(), state
    root = state.state_details.flow_run_id
    assert open_runs_under(root) == []
    own, kids, ops = children_of(root, 1)
    (kid,) = kids.values()
    assert kid.state.is_failed() and f"{broken} failed: injected fault" in kid.state.message, kid.state
    (pending,) = [r for r in ops[kid.id] if r.name == held]
    assert pending.state.is_failed() and "the training run ended Failed" in pending.state.message, pending.state


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


def test_what_an_attempt_left_open_is_ended_by_the_next_command_as_the_attempt_recorded(prefect_api, tmp_path):
    """The record a run folder keeps of its attempts (`tasks/leftovers.py`): an attempt that
    left its flow run, an iteration's flow run and a task run open (killed, or its API away at
    its end) has them ended by the next command that touches the run (`store audit` and
    `report` call this): Crashed when it never said how it ended, else as it recorded; once
    closed, it is not asked again."""
    from prefect import get_client
    from prefect.states import Pending, Running

    from flexmarl_core.runfiles.location import RunLocation
    from tasks import leftovers
    from tasks.iteration_runs import _TRACKING, ITERATION_FLOW
    from tests._runs import open_runs_under

    loc = RunLocation(tmp_path / "run")
    (tmp_path / "run").mkdir()
    made = []
    with get_client(sync_client=True) as c:
        for _ in range(2):
            top = c.create_flow_run(ITERATION_FLOW, name="attempt", state=Running())
            tracking = c.create_task_run(_TRACKING, top.id, dynamic_key="it 0", name="x it 0", state=Running())
            kid = c.create_flow_run(ITERATION_FLOW, name="x it 0", parent_task_run_id=tracking.id, state=Running())
            c.create_task_run(_TRACKING, kid.id, dynamic_key="op", name="rollout[a] it=0 mb=0", state=Pending())
            made.append(str(top.id))
    killed, unreported = made
    leftovers.begin(loc, killed, prefect_api)  # killed: it never said how it ended
    leftovers.begin(loc, unreported, prefect_api)
    leftovers.end(loc, unreported, None)  # it completed while its API was away
    assert open_runs_under(killed, patience_s=0) and open_runs_under(unreported, patience_s=0)
    assert leftovers.close_for_command(loc) == 8
    assert open_runs_under(killed) == [] and open_runs_under(unreported) == []
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(killed).state.is_crashed()
        assert "ended without ending the run" in c.read_flow_run(killed).state.message
        assert c.read_flow_run(unreported).state.is_completed()
    assert all(a["closed"] for a in json.loads(loc.read_text(leftovers.RECORD))["attempts"])
    assert leftovers.close_for_command(loc) == 0


def test_a_flow_run_of_two_iterations_holds_their_ops_and_draws_the_edges_between_them(
        prefect_api, dask_cluster, tmp_path):
    """`cluster.iterations_per_flow_run=2` on the real flow: both iterations in one nested flow
    run, whose graph draws the edge from iteration 0's sync to iteration 1's ops that waited for
    it (no `waited on` line then), with both iterations' lines and one artifact."""
    from flexmarl_core.config import load_config
    from flexmarl_core.orchestrator.plan import Plan
    from tests._runs import COMMON, TINY, flow

    overrides = [f"run_dir={tmp_path / 'run'}", f"cluster.address={dask_cluster}", *COMMON,
                 "cluster.iterations_per_flow_run=2"]
    state = flow(overrides)
    assert state.is_completed(), state
    cfg = load_config(TINY, overrides)
    own, kids, ops = children_of(state.state_details.flow_run_id, 1)
    (kid,) = kids.values()
    assert kid.name == f"{cfg.name} it 0-{ITERATIONS - 1}" and kid.state.is_completed(), (kid.name, kid.state)
    assert kid.parameters == {"iteration": 0, "last": ITERATIONS - 1}
    runs = {r.name: r for r in ops[kid.id]}
    assert len(runs) == len(Plan.build(cfg).deps) and all(r.state.is_completed() for r in runs.values())
    sync = runs["sync[solver] it=0"].id
    assert [n for n, r in runs.items() if " it=1" in n and sync in [x.id for xs in r.task_inputs.values() for x in xs]]
    logs, arts = asyncio.run(records([kid.id]))
    assert [m.split("  ")[0] for m in logs[kid.id] if m.startswith("iteration ")] == [
        f"iteration {i + 1}/{ITERATIONS}" for i in range(ITERATIONS)], logs[kid.id]
    assert not [m for m in logs[kid.id] if m.startswith("waited on")] and "waited on" not in kid.state.message
    (art,) = arts[kid.id]
    assert all(n in art.data for n in runs), art.data
