"""What a training run leaves open in the Prefect API, ended in the run's own final state.

A training flow run ends its iterations' flow runs and its ops' task runs itself when it ends
(`tasks/iteration_runs.py`, `tasks/task_runs.py`), in the state that matches its own:
Completed, Failed, Crashed (an interrupt, a termination) or Cancelled, with the reason. What it
cannot end (its process was killed with -9, or the API was gone when it ended) the next command
that touches the run ends: `flexmarl train --resume` (or `--overwrite`), `flexmarl store audit`
and `flexmarl report`. They find it through the run folder's record of its attempts:

    RUN/prefect-runs.json   {"attempts": [{"flow_run", "api", "pid", "host", "ended", "message",
                                           "closed"}, ...]}

`ended` is the attempt's own final state type (null while it runs, or when it was killed);
`closed` is set once the API holds nothing of it still open. An attempt that ended without
saying how is Crashed. Only the API the attempt reported to is asked (its `api`), and only
for an attempt whose process no longer holds the run's lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from typing import Any

from flexmarl_core.driver.lease import Lease, read_lease
from flexmarl_core.runfiles.location import RunLocation

log = logging.getLogger("flexmarl")

#: the run folder's record of its attempts' flow runs (module docstring)
RECORD = "prefect-runs.json"
#: state types a run or task run may still leave (the API's other types are final)
OPEN_TYPES = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING")
_NAMES = {"COMPLETED": "Completed", "FAILED": "Failed", "CRASHED": "Crashed", "CANCELLED": "Cancelled"}


def ending(error: BaseException | None) -> str:
    """The final state type that matches how a run ended: COMPLETED (no error), CANCELLED
    (Prefect's cancellation of the flow run), CRASHED (an interrupt, exit or termination
    signal, as Prefect's engine calls those) or FAILED (an exception)."""
    if error is None:
        return "COMPLETED"
    try:
        from prefect._internal.control_listener import get_intent
        from prefect.exceptions import TerminationSignal

        if isinstance(error, TerminationSignal) and get_intent() == "cancel":
            return "CANCELLED"
    except ImportError:  # a Prefect without the control listener: no cancellation to tell
        pass
    return "FAILED" if isinstance(error, Exception) else "CRASHED"


def reason(type_: str, error: BaseException | None) -> str:
    """The message an open run gets when it is ended with its training run."""
    if error is None:
        return "the training run completed"
    said = str(error).strip().splitlines()
    return f"the training run ended {_NAMES[type_]}: {type(error).__name__}" + (f": {said[0][:400]}" if said else "")


def state(type_: str, message: str) -> Any:
    """A Prefect state of `type_` (one of `_NAMES`) with `message`."""
    from prefect.client.schemas.objects import State, StateType

    return State(type=StateType(type_), name=_NAMES[type_], message=message)


# -- the record ------------------------------------------------------------------------------
def _read(loc: RunLocation) -> list[dict[str, Any]]:
    try:
        return list(json.loads(loc.read_text(RECORD))["attempts"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or torn: nothing to close
        return []


def _write(loc: RunLocation, attempts: list[dict[str, Any]]) -> None:
    loc.write_text(RECORD, json.dumps({"attempts": attempts}, indent=1))


def _update(loc: RunLocation, flow_run: str, **changes: Any) -> None:
    attempts = _read(loc)
    mine = [a for a in attempts if a["flow_run"] == flow_run]
    for a in mine:
        a.update(changes)
    if mine:  # an attempt that stopped before `begin` (a folder it may not write) writes nothing
        _write(loc, attempts)


def begin(loc: RunLocation, flow_run: str, api: str | None) -> None:
    """This attempt's flow run, added to the run folder's record (once per attempt)."""
    attempts = [a for a in _read(loc) if a["flow_run"] != flow_run]
    _write(loc, [*attempts, {"flow_run": flow_run, "api": api, "pid": os.getpid(), "host": socket.gethostname(),
                             "ended": None, "message": None, "closed": False}])


def end(loc: RunLocation, flow_run: str, error: BaseException | None) -> None:
    """How this attempt ended, for the command that closes what the API did not take."""
    type_ = ending(error)
    try:
        _update(loc, flow_run, ended=type_, message=reason(type_, error))
    except OSError as exc:  # the run folder is gone or full: the attempt counts as Crashed later
        log.warning("could not record how flow run %s ended in %s: %s", flow_run, loc.display(RECORD), exc)


# -- closing ---------------------------------------------------------------------------------
def close_runs(client: Any, flow_run_id: str | uuid.UUID, type_: str, message: str) -> int:
    """End `flow_run_id`, its nested flow runs and the task runs of both that are still open,
    in state `type_` with `message`; how many were ended."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )

    root = uuid.UUID(str(flow_run_id))
    open_runs = FlowRunFilterState(type=FlowRunFilterStateType(any_=list(OPEN_TYPES)))
    open_tasks = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=list(OPEN_TYPES))))
    done: set[uuid.UUID] = set()

    def end_all(read: Any, set_state: Any) -> None:
        # Each page holds the runs still open: it shrinks as they end (a page of runs already
        # ended, which the API did not take, stops the loop).
        while fresh := [r for r in read() if r.id not in done]:
            for r in fresh:
                set_state(r.id, state(type_, message), force=True)
                done.add(r.id)

    for under in (FlowRunFilter(id=FlowRunFilterId(any_=[root])),
                  FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[root]))):
        end_all(lambda under=under: client.read_task_runs(flow_run_filter=under, task_run_filter=open_tasks,
                                                          limit=200), client.set_task_run_state)
    kids = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[root]), state=open_runs)
    end_all(lambda: client.read_flow_runs(flow_run_filter=kids, limit=200), client.set_flow_run_state)
    ended = len(done)
    top = client.read_flow_run(root)
    if top.state is not None and not top.state.is_final():
        client.set_flow_run_state(root, state(type_, message), force=True)
        ended += 1
    return ended


def _same_api(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and a.rstrip("/") == b.rstrip("/")


def close_earlier(loc: RunLocation, api: str | None, *, current: str | None = None,
                  stale: Lease | None = None) -> int:
    """End what earlier attempts of the run in `loc` left open in the API at `api` (module
    docstring); `current`: this attempt's flow run, left alone; `stale`: a lease taken over
    (its flow run may predate the record). Returns how many runs were ended. The API's
    errors are logged, not raised: a record it cannot serve stays for the next command."""
    if not api:
        return 0
    lease = None if stale is not None else _lease(loc)
    live = lease.flow_run if lease is not None and lease.alive() else None
    attempts = _read(loc)
    todo = [a for a in attempts if not a.get("closed") and a["flow_run"] not in (current, live)
            and _same_api(a.get("api"), api)]
    if stale is not None and stale.flow_run and stale.flow_run not in {a["flow_run"] for a in attempts} \
            and stale.flow_run != current:
        todo.append({"flow_run": stale.flow_run, "pid": stale.pid, "host": stale.host, "ended": None, "api": api})
    if not todo:
        return 0
    from prefect.client.orchestration import get_client

    ended = 0
    try:
        with get_client(sync_client=True) as client:
            for a in todo:
                type_ = a.get("ended") or "CRASHED"
                message = a.get("message") or (f"its process (pid {a.get('pid')} on {a.get('host')}) ended "
                                               "without ending the run")
                ended += close_runs(client, a["flow_run"], type_, message)
                if any(b["flow_run"] == a["flow_run"] for b in attempts):
                    _update(loc, a["flow_run"], closed=True)
    except Exception as exc:  # a flow run of another server, or the API away: the next command tries
        log.info("runs left open by earlier attempts of %s not ended: %s: %s", loc.uri, type(exc).__name__, exc)
    if ended:
        log.info("ended %d flow and task runs earlier attempts of %s left open", ended, loc.uri)
    return ended


def _lease(loc: RunLocation) -> Lease | None:
    try:
        return read_lease(loc)
    except Exception:  # a foreign file there: no owner to spare
        return None


def close_for_command(loc: RunLocation) -> int:
    """What a command that touches the run in `loc` (`store audit`, `report`) ends: what its
    attempts left open, on the API each reported to when it answers (a lease taken from a dead
    owner before the record existed: on this process's API, or the local server flexmarl
    started). Returns how many runs were ended."""
    from flexmarl.prefect_api import _answers, _home, current_api_url, our_server, own_auth

    attempts = [a for a in _read(loc) if not a.get("closed") and a.get("api")]
    lease = _lease(loc)
    stale = lease if lease is not None and lease.flow_run and not lease.alive() else None
    apis = list(dict.fromkeys(a["api"] for a in attempts))
    ambient = None
    if stale is not None:
        own = our_server(_home())
        ambient = current_api_url() or (own["url"] if own else None)
        if ambient and ambient not in apis:
            apis.append(ambient)
    if not apis:
        return 0
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    ended = 0
    for api in apis:
        if not _answers(api):
            continue
        auth = own_auth(api)  # a server flexmarl started demands its string; others get the user's
        with temporary_settings(updates={PREFECT_API_URL: api, **({PREFECT_API_AUTH_STRING: auth} if auth else {})}):
            ended += close_earlier(loc, api, stale=stale if _same_api(api, ambient) else None)
    return ended
