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


def test_a_flow_run_holds_several_iterations_by_count_or_by_the_runs_pace(prefect_api):
    """`per_flow_run=3`: seven iterations in three flow runs, each recorded and completed once
    all of its iterations are final. `auto` (per_flow_run None), an iteration every 0.1 s on a
    fed clock: one flow run each until three have ended, then the rest of the run in one (5 s
    of it would be 50 iterations). `per_flow_run=5` on a resumed attempt whose iterations 4-7
    ran before: the flow run from 3 takes only 3, and ends once 3 is final and 8 has begun."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from tasks.iteration_runs import IterationFlowRuns

    n = 7
    cases = (("three", 3, range(n)), ("auto", None, range(n)), ("resumed", 5, [3, 8]))
    total = {"three": n, "auto": n, "resumed": 9}

    @flow
    def iterations() -> dict:
        calls = {}
        with get_client(sync_client=True) as client:
            for name, per, its_run in cases:
                now = [0.0]
                its = IterationFlowRuns(client, flow_run.get_id(), run_name=name, iterations=total[name], end_lag_s=0.0,
                                        per_flow_run=per, clock=lambda now=now: now[0])
                ids = []
                for k, it in enumerate(its_run):
                    now[0] = 0.1 * k
                    its.flow_run_id(it)  # its first op is submitted
                    now[0] = 0.1 * (k + 1)
                    its.finished(it, _row(it))
                    ids.append(its.block(it))
                assert its.close(None)
                calls[name] = (dict(its.calls), ids)
        return calls

    state = iterations(return_state=True)
    calls = state.result()
    assert calls["three"][1] == [0, 0, 0, 3, 3, 3, 6]
    assert calls["auto"][1] == [0, 1, 2, 3, 3, 3, 3]
    assert calls["resumed"][1] == [3, 8]
    for name, opened in (("three", 3), ("auto", 4), ("resumed", 2)):
        got = calls[name][0]
        assert got["open"] == got["artifact"] == got["state"] == opened and got["logs"] <= opened, (name, got)
    own, kids, _ = children_of(state.state_details.flow_run_id, 9)
    names = {"three it 0-2": [0, 1, 2], "three it 3-5": [3, 4, 5], "three it 6": [6],
             "auto it 0": [0], "auto it 1": [1], "auto it 2": [2], "auto it 3-6": [3, 4, 5, 6],
             "resumed it 3-7": [3], "resumed it 8": [8]}
    assert sorted(k.name for k in kids.values()) == sorted(names)
    tracking = {r.name: r for r in own}
    logs, arts = asyncio.run(records(list(kids)))
    for kid in kids.values():
        its, run = names[kid.name], kid.name.split()[0]
        # Completed once its last iteration is, with that iteration's line; its tracking task run too.
        assert kid.state.is_completed() and kid.state.message.startswith(f"iteration {its[-1] + 1}/{total[run]}"), kid.state
        assert tracking[kid.name].state.is_completed() and tracking[kid.name].state.state_details.child_flow_run_id == kid.id
        first, last = (int(x) for x in kid.name.split()[-1].split("-")) if "-" in kid.name else (its[0], its[0])
        assert kid.parameters == ({"iteration": first, "last": last} if last != first else {"iteration": first})
        assert [m for m in logs[kid.id] if m.startswith("iteration ")] == [
            f"iteration {it + 1}/{total[run]}  E2E 0.25 s  acc 0.500  util 0.90" for it in its], logs[kid.id]
        (art,) = arts[kid.id]
        assert all(f"# {run} it {it}\n" in art.data for it in its) and f"# {run} it {its[-1] + 1}\n" not in art.data
