"""How ops show as Prefect task runs (`tasks/stages.py` `TaskRunReporter`), against the real
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

    from tasks.stages import TaskRunReporter

    delay = 0.3

    @flow
    def reports() -> dict:
        r = TaskRunReporter(flow_run.get_id(), 1, pending_after_s=delay)
        t0 = time.time()
        r.submitted(SHORT, [], t0)
        r.submitted(LONG, [SHORT], t0)
        r.finished(SHORT, StageResult(SHORT, t_start=t0, t_end=t0 + 0.01))
        assert r.report_pending(time.time()) == t0 + delay  # LONG is not due yet
        time.sleep(delay)
        assert r.report_pending(time.time()) is None  # now it is reported, and nothing waits
        ids = {"short": r.task_run_id(SHORT), "long": r.task_run_id(LONG)}
        seen_while_running = asyncio.run(_state_of(ids["long"]))
        r.finished(LONG, StageResult(LONG, t_start=t0 + 0.05, t_end=time.time()))
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
