"""How long a training run's reports wait for a Prefect API that stopped answering.

Training never waits on the API. While the run goes, reports that the API cannot take wait
for it (task-run events in Prefect's events client, the iterations' flow runs on their own
thread), however long the run goes on. Once the run's last op is done, one budget, `GIVE_UP_S`
from the moment the API was first seen not answering (or from the last op, if it answered
until then), covers everything still to report: the iterations' flow runs, the run's
artifacts and the flow run's own end. Past it the API counts as dead: what is queued for it is
dropped, and the flow run's own end is tried once, not with the client's backoff (~4
minutes with `flexmarl train`'s `PREFECT_CLIENT_MAX_RETRIES=7`), so the process ends about a
minute after its last op at most. The budget does not grow with what is queued.

`FLEXMARL_API_GIVE_UP_S` sets the budget (seconds, default 60).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request

log = logging.getLogger("flexmarl")

#: seconds the run's end waits for an API that does not answer (module docstring)
GIVE_UP_S = 60.0
#: between two looks at the API's health while waiting
POLL_S = 2.0


def give_up_s() -> float:
    try:
        return float(os.environ.get("FLEXMARL_API_GIVE_UP_S", GIVE_UP_S))
    except ValueError:
        return GIVE_UP_S


def _healthy(api: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(api.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status < 500
    except OSError:  # refused, timed out, or an HTTP error status
        return False


class ApiWatch:
    """One run's view of its API: when it was first seen not answering, when the run's last op
    was done, and whether the run has given up on it (`dead`)."""

    def __init__(self, api: str | None, give_up: float | None = None) -> None:
        self.api = api
        self.give_up_s = give_up_s() if give_up is None else give_up
        #: when the API was first seen not answering, in the current outage (None: it answers)
        self.failing_since: float | None = None
        #: when the run's last op was done (`ended`)
        self.ended_at: float | None = None
        self.dead = threading.Event()

    def answered(self) -> None:
        self.failing_since = None

    def failed(self) -> None:
        if self.failing_since is None:
            self.failing_since = time.monotonic()

    def ended(self) -> None:
        """The run's last op is done: the budget's clock runs from here at the latest."""
        if self.ended_at is None:
            self.ended_at = time.monotonic()

    def deadline(self) -> float:
        """When the run stops waiting for the API (monotonic clock)."""
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        since = end if self.failing_since is None else min(self.failing_since, end)
        return since + self.give_up_s

    def settle(self) -> bool:
        """Wait until the API answers (True) or the budget is spent (False: `give_up`)."""
        if self.api is None:
            return True
        if self.dead.is_set():
            return False
        while True:
            if _healthy(self.api):
                self.answered()
                return True
            self.failed()
            if time.monotonic() >= self.deadline():
                self.give_up()
                return False
            time.sleep(POLL_S)

    def give_up(self) -> None:
        """The API is dead for this run: drop what waits for it, and make the calls still to
        come try once."""
        if self.dead.is_set():
            return
        self.dead.set()
        log.warning("the Prefect API at %s has not answered for %.0f s since the run's last op; "
                    "giving up on it (the run's own records are complete)", self.api, self.give_up_s)
        _no_more_retries()
        from flexmarl.prefect_api import drop_unsent

        drop_unsent()


def _no_more_retries() -> None:
    """Prefect's client reads `PREFECT_CLIENT_MAX_RETRIES` at every try, from the calling
    thread's settings (the flow's) or the process's (its background services): set both to 0
    so a call to a dead API fails at its first try instead of backing off for minutes."""
    import prefect.context
    from prefect.settings import get_current_settings

    process = getattr(prefect.context, "GLOBAL_SETTINGS_CONTEXT", None)
    for settings in (get_current_settings(), process.settings if process is not None else None):
        if settings is not None:
            settings.client.max_retries = 0
