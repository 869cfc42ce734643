"""The iterations' flow runs cost the API few calls (`tasks/iteration_runs.py`): the ends of
iterations that come close together are recorded together, their log lines in one call, and
nothing waiting for that is lost when the run ends; the tracking task runs take their states
from the server, with no call of their own."""

from __future__ import annotations

import asyncio
import time

from tests.stack.test_iteration_runs import children_of, records


def _row(it: int) -> dict:
    return {"iteration": it, "e2e_s": 0.25, "accuracy": 0.5, "utilization": 0.9, "tokens": 100}


def test_ends_close_together_are_recorded_in_one_call_and_none_is_lost_at_the_end(prefect_api):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from tasks.iteration_runs import IterationFlowRuns

    n = 5

    @flow
    def iterations() -> dict:
        with get_client(sync_client=True) as client:
            # A short lag: iteration 0's record goes alone once it is over, before the others end.
            its = IterationFlowRuns(client, flow_run.get_id(), run_name="calls", iterations=n, end_lag_s=0.2)
            its.finished(0, _row(0))
            deadline = time.monotonic() + 60
            while its.calls["state"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            alone = dict(its.calls)
            # A lag no test waits out: the rest end only because the run does.
            its.end_lag_s = 3600.0
            for it in range(1, n):
                its.finished(it, _row(it))
            assert its.close(None)
            return {"alone": alone, "all": dict(its.calls)}

    state = iterations(return_state=True)
    calls = state.result()
    assert calls["alone"] == {"open": 1, "logs": 1, "artifact": 1, "state": 1}, calls
    # One flow run, one artifact and one state each; the log lines of the four in one call.
    assert calls["all"] == {"open": n, "logs": 2, "artifact": n, "state": n}, calls
    own, kids, _ = children_of(state.state_details.flow_run_id, n)
    assert sorted(k.name for k in kids.values()) == [f"calls it {i}" for i in range(n)]
    tracking = {r.name: r for r in own}
    for kid in kids.values():
        assert kid.state.is_completed() and kid.state.message.startswith(f"iteration {int(kid.name[-1]) + 1}/{n}")
        # Completed by the server as its flow run was (`UpdateSubflowParentTask`), never by a call.
        assert tracking[kid.name].state.is_completed(), tracking[kid.name].state
        assert tracking[kid.name].state.state_details.child_flow_run_id == kid.id
    logs, arts = asyncio.run(records(list(kids)))
    for kid in kids.values():
        it = int(kid.name[-1])
        assert [m for m in logs[kid.id] if m.startswith("iteration ")] == [
            f"iteration {it + 1}/{n}  E2E 0.25 s  acc 0.500  util 0.90"], logs[kid.id]
        (art,) = arts[kid.id]
        assert art.type == "markdown" and f"# calls it {it}" in art.data
