"""How ops show as Prefect task runs (`tasks/task_runs.py` `TaskRunReporter`), against the real
API of the session's test server: an op that ends within `pending_after_s` of its submission
is one event, its final state; a longer one shows Pending while it runs, then its end."""

from __future__ import annotations

import asyncio
import time
import uuid

from flexmarl_core.ops import Op, StageResult

SHORT = Op(0, "reward", mb=0)
LONG = Op(0, "train", "solver", mb=0)


async def _states(task_run_id: uuid.UUID) -> list[str]:
    from prefect import get_client

    async with get_client() as c:
        return [s.type.value for s in sorted(await c.read_task_run_states(task_run_id), key=lambda s: s.timestamp)]


async def _state_of(task_run_id: uuid.UUID, patience_s: float = 60.0) -> str | None:
    """The task run's state once the server has recorded it (it records events in batches)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    async with get_client() as c:
        for _ in range(int(patience_s / 0.25)):
            try:
                tr = await c.read_task_run(task_run_id)
                if tr.state is not None:
                    return tr.state.type.value
            except ObjectNotFound:
                pass
            await asyncio.sleep(0.25)
    return None


def test_short_op_is_one_event_long_op_shows_pending_while_it_runs(prefect_api):
    from prefect import flow
    from prefect.runtime import flow_run

    from tasks.task_runs import TaskRunReporter

    delay = 0.3
    now = [100.0]  # the flow's clock, given here: the test does not race the wall clock

    @flow
    def reports() -> dict:
        r = TaskRunReporter(flow_run.get_id(), 1, pending_after_s=delay, clock=lambda: now[0])
        t0 = now[0]
        r.submitted(SHORT, [], t0)
        r.submitted(LONG, [SHORT], t0)
        r.finished(SHORT, StageResult(SHORT, t_start=t0, t_end=t0 + 0.01))
        now[0] += 0.1
        assert r.report_due(now[0]) == t0 + delay  # LONG is not due yet (SHORT's state is held)
        now[0] = t0 + delay
        assert r.report_due(now[0]) is None  # now it is reported (SHORT's before it), nothing waits
        ids = {"short": r.task_run_id(SHORT), "long": r.task_run_id(LONG)}
        seen_while_running = asyncio.run(_state_of(ids["long"]))
        now[0] += 1.0
        r.finished(LONG, StageResult(LONG, t_start=t0 + 0.05, t_end=now[0]))
        r.flush()  # the training flow does this at its end
        return {**ids, "while_running": seen_while_running}

    out = reports()
    assert out["while_running"] == "PENDING"
    assert asyncio.run(_state_of(out["short"])) == "COMPLETED"
    assert asyncio.run(_states(out["short"])) == ["COMPLETED"]  # one event: no Pending
    for _ in range(120):  # the long one's Completed may still be in the server's batch
        if asyncio.run(_state_of(out["long"])) == "COMPLETED":
            break
        time.sleep(0.25)
    assert asyncio.run(_states(out["long"])) == ["PENDING", "COMPLETED"]


def test_final_states_are_held_for_flush_s_and_a_failure_sends_them_first(prefect_api):
    """Final states of ops that went well wait up to `flush_s` and go together; a failure goes
    at once with what was held before it, in order. The clock is the flow's, given here."""
    from prefect import flow
    from prefect.runtime import flow_run

    from tasks.task_runs import TaskRunReporter

    now = [100.0]
    ok, bad = Op(0, "reward", mb=1), Op(0, "rollout", "solver", mb=1)

    @flow
    def reports() -> dict:
        r = TaskRunReporter(flow_run.get_id(), 1, pending_after_s=60.0, flush_s=2.0, clock=lambda: now[0])
        r.submitted(SHORT, [], now[0])
        r.finished(SHORT, StageResult(SHORT, t_start=now[0], t_end=now[0] + 0.01))
        now[0] += 1.0
        held_due = r.report_due(now[0])  # held since 100.0: due at 102.0
        now[0] += 1.0
        after_due = r.report_due(now[0])  # sent: nothing waits
        r.submitted(ok, [SHORT], now[0])
        r.submitted(bad, [], now[0])
        r.finished(ok, StageResult(ok, t_start=now[0], t_end=now[0] + 0.01))
        r.failed(bad, RuntimeError("stage broke"), now[0] + 0.02)  # sends ok's held state first
        return {"held_due": held_due, "after_due": after_due,
                "ids": [r.task_run_id(o) for o in (SHORT, ok, bad)]}

    out = reports()
    assert out["held_due"] == 102.0 and out["after_due"] is None
    states = [asyncio.run(_state_of(i)) for i in out["ids"]]
    assert states == ["COMPLETED", "COMPLETED", "FAILED"]
