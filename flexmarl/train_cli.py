"""`flexmarl train`: the config's checks, the local cluster started ahead, the Prefect API, the
run folder's lease, then the training flow; the summary, or one line saying why the run stopped."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from flexmarl_core.config.checks import ConfigError  # light: no pydantic models at parse time

#: Prefect client retries of the flow run's own API calls (exponential backoff: ~4 minutes)
API_RETRIES = 7


def _config(args: argparse.Namespace):  # noqa: ANN202 - avoids importing pydantic models at parse time
    from flexmarl_core.config import load_config

    return load_config(args.config, args.set)


def _resume_config(args: argparse.Namespace) -> None:
    """`train --resume RUN`: the run's own saved config is the config."""
    from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation, is_uri

    if args.config is not None:
        raise ConfigError("give either CONFIG or --resume RUN, not both (a resumed run keeps its config)")
    loc = RunLocation(args.resume)
    if not loc.is_file(CONFIG_NAME):
        raise ConfigError(f"--resume {args.resume}: no {CONFIG_NAME} there (not a flexmarl run folder)")
    if not is_uri(args.resume):
        args.config = str(Path(loc.root) / CONFIG_NAME)
        return
    # A run on object storage: its saved config, copied to this machine (the flow reads a file),
    # its folder named where the copy says "this folder".
    from flexmarl_core.config.load import HERE

    local = loc.scratch_dir() / CONFIG_NAME
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(loc.read_text(CONFIG_NAME).replace(HERE, loc.uri))
    args.config = str(local)


def cmd_train(args: argparse.Namespace) -> int:
    # Prefect's log lines (flow and task run states, a failure's traceback) stay in its API and
    # UI; the terminal shows the UI link, a line per iteration and the summary, or one line
    # saying why the run stopped (--debug: Prefect's warnings and tracebacks too, and Dask's).
    # Set before Prefect is imported; the workers inherit FLEXMARL_DEBUG.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING" if args.debug else "CRITICAL")
    if not args.debug:  # Prefect's own machinery (its event and log shippers) logs apart
        os.environ.setdefault("PREFECT_LOGGING_INTERNAL_LEVEL", "CRITICAL")
    if args.debug:
        os.environ["FLEXMARL_DEBUG"] = "1"
    # Training never waits on the API (task-run events are buffered and resent by Prefect's
    # events client), but the flow run's own states are API calls: 7 retries back off for
    # 2+4+...+128 s, so an API server away for up to ~4 minutes is ridden out (at the run's end,
    # one budget of about a minute covers every report instead: tasks/api_watch.py).
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", str(API_RETRIES))
    if args.resume:
        _resume_config(args)
    elif args.config is None:
        raise ConfigError("train: give a CONFIG file, or --resume RUN to continue a run")
    cfg = _config(args)  # validate before starting anything
    from flexmarl_core.cluster.workers import close_ahead, start_ahead

    try:
        _cluster_checks(cfg)
    except ConfigError as exc:
        raise _naming_the_config(exc, args) from None
    # The local cluster starts now, its workers importing torch on the other core while this
    # process imports its own and runs the checks below; a launch they refuse stops it again.
    start_ahead(cfg.cluster)
    try:
        return _train(args, cfg)
    finally:
        close_ahead()


def _naming_the_config(exc: Exception, args: argparse.Namespace) -> ConfigError:
    """A check's refusal as one line that names the config file too."""
    said = str(exc)
    return ConfigError(said if args.config in said else f"{args.config}: {said}")


def _cluster_checks(cfg) -> None:  # noqa: ANN001 - an ExperimentConfig
    """What the config asks of the cluster: tags every op kind can be placed by, a device
    this machine has for a local cluster, a scheduler address that answers."""
    from flexmarl_core.cluster.workers import check_address, check_worker_tags

    check_worker_tags(cfg)
    if cfg.cluster.device != "cpu" and cfg.cluster.address is None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"cluster.device {cfg.cluster.device!r}: torch sees no CUDA device on this "
                              "machine (the local cluster's workers run here); use cpu")
    if cfg.cluster.address:
        check_address(cfg.cluster.address)


def _train(args: argparse.Namespace, cfg) -> int:  # noqa: ANN001 - an ExperimentConfig
    from flexmarl.prefect_api import drop_unsent, ensure_api, ui_url
    from flexmarl_core.driver.console import console
    from flexmarl_core.driver.failures import stopped_line

    try:
        _preflight(cfg, resume=bool(args.resume), overwrite=args.overwrite, check_store=not args.skip_check)
    except ConfigError as exc:
        raise _naming_the_config(exc, args) from None
    skipped = _skipped_check(cfg) if args.resume and args.skip_check else None  # said with the summary
    api, started = ensure_api(cfg.cluster.prefect_api_url)
    if started:
        console.print(f"started a local Prefect server at {ui_url(api)} (stop: flexmarl server stop)")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.secrets import check_references

    with temporary_settings(updates={PREFECT_API_URL: api}):  # `${secret:..}` blocks live there
        check_references(cfg)  # an unset variable or missing block: one line, before any folder
    lease = _take_run_folder(cfg, args)  # after every check: a launch refused earlier makes no folder
    import httpx

    from flexmarl_core.runtime.startup import freeze_imports
    from flows.train import train

    freeze_imports()  # the run's own collections skip the imports

    if not args.debug:  # an API that went away is one line of ours, not Prefect's retries' noise
        import logging

        logging.raiseExceptions = False  # Prefect's log shipper writes its failures to stderr otherwise
        for name in ("prefect.events.clients", "prefect.client"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    # Settings may have been loaded before ensure_api set the env var: pin the API explicitly.
    started_at = time.time()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        try:
            state = train(args.config, args.set, progress=not args.no_progress, resume=bool(args.resume),
                          overwrite=args.overwrite, return_state=True)
        except httpx.TransportError as exc:  # the API stayed away past every retry
            drop_unsent()  # what it could not take: the process's exit must not retry it all
            out = _finished(cfg, started_at)
            if out is not None:  # the training finished: only its end could not be reported
                _print_summary(out)
                console.print(f"the run finished, but the Prefect API at {api} stopped answering "
                              f"({type(exc).__name__}), so its UI does not show the run's end", style="yellow",
                              markup=False, soft_wrap=True)
                _exit_now(0, lease)
            console.print(f"run stopped: the Prefect API at {api} did not answer "
                          f"({type(exc).__name__}: {exc}); what finished is stored: start the API, "
                          f"then `flexmarl train --resume {cfg.run_location().uri}`", style="red", markup=False)
            _exit_now(1, lease)
    if not state.is_completed():
        exc = state.result(raise_on_failure=False)
        if args.debug and isinstance(exc, BaseException):
            traceback.print_exception(exc)
        line = (stopped_line(exc, cfg.run_location().uri) if isinstance(exc, BaseException)
                else f"run stopped: {state.message}")
        console.print(line, style="red", markup=False, soft_wrap=True)  # `[solver]` is text, not markup
        return 1
    _print_summary(state.result(), skipped)
    return 0


def _take_run_folder(cfg, args: argparse.Namespace):  # noqa: ANN001, ANN202 - a config, a RunLease
    """The run folder's lease, taken before any flow run exists (the flow adopts it, and
    releases it at its end; at the latest, this process's exit does): a launch that cannot have
    it, a second launch or the loser of two at the same moment, is refused with the same one
    line as `_preflight`'s and leaves no flow run behind."""
    import atexit

    from flexmarl_core.driver.lease import RunExistsError, RunLease, RunLockedError
    from flexmarl_core.driver.run import RunFolderError

    try:
        lease = RunLease.acquire(cfg.run_location(), resume=bool(args.resume), overwrite=args.overwrite)
    except (RunLockedError, RunExistsError, RunFolderError) as exc:
        raise _naming_the_config(exc, args) from None
    atexit.register(lease.release)
    return lease


def _exit_now(code: int, lease) -> NoReturn:  # noqa: ANN001 - a RunLease
    """The Prefect API is dead and the last line is printed: end the process now, without
    Prefect's exit-time flushes to the dead API (`tasks/api_watch.py`)."""
    lease.release()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _finished(cfg, since: float) -> dict | None:  # noqa: ANN001 - an ExperimentConfig
    """The summary this launch's run wrote at its end (`tasks.report.SUMMARY_NAME`), if any."""
    from tasks.report import SUMMARY_NAME

    path = cfg.run_location().scratch_dir() / "metrics" / SUMMARY_NAME
    if not path.is_file() or path.stat().st_mtime < since:
        return None
    return json.loads(path.read_text())


def _print_summary(out: dict, note: str | None = None) -> None:
    from flexmarl_core.driver.console import console, summary_lines, summary_table

    console.print(summary_table(out["iterations"], out["summary"]))
    for line in summary_lines(out["summary"]):
        console.print(line, soft_wrap=True)  # a long path stays one line, not broken mid-word
    if note:
        console.print(note, style="yellow", markup=False, soft_wrap=True)


def _skipped_check(cfg) -> str:  # noqa: ANN001 - an ExperimentConfig
    """What `--resume --skip-check` skips, for the summary: the store check, and the damage a
    footer scan finds now."""
    from flexmarl_core.driver.repair import skipped_check
    from storage import StoreError

    try:
        return skipped_check(cfg.run_location().uri)
    except (OSError, ValueError, StoreError) as exc:
        return f"--skip-check: the store was not checked before the resume (a scan of it failed: {exc})"


def _preflight(cfg, *, resume: bool, overwrite: bool = False, check_store: bool = True) -> None:  # noqa: ANN001
    """Check what the config points at, now: a broken dataset row or reward callable, a missing
    warm-start checkpoint, a run folder another run holds or a resume that cannot work fails
    here, as a one-line error, before a Prefect server or a half-made run folder exists (the
    cluster started ahead is stopped again; `_cluster_checks` ran before it started)."""
    from flexmarl_core.workloads import WorkloadError, make_workload

    try:
        make_workload(cfg.workload, cfg.team)
    except WorkloadError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.train.init_from and not resume:
        root = Path(cfg.train.init_from)
        missing = [a.name for a in cfg.team.agents if not (root / a.name / "model.safetensors").is_file()]
        if missing:
            raise ConfigError(
                f"train.init_from {cfg.train.init_from!r}: no <agent>/model.safetensors for "
                f"{missing} (resolved: {root.absolute()}); point it at the output of `flexmarl sft`"
            )
    from flexmarl_core.driver.lease import RunExistsError, RunLockedError, check_claim
    from flexmarl_core.driver.repair import DamagedStoreError, check_before_resume
    from flexmarl_core.driver.run import (
        ResumeError,
        RunFolderError,
        check_resumable,
        check_run_folder,
    )
    from flexmarl_core.runfiles.location import LocationError, check_reachable

    try:
        check_reachable("run_dir", cfg.run_dir.format(name=cfg.name))
        check_reachable("store.uri", cfg.resolved_store_uri())
        if not resume:  # first: a folder that is not a run's is never offered for --overwrite
            check_run_folder(cfg.run_location(), cfg.train.init_from)
        check_claim(cfg.run_location(), resume=resume, overwrite=overwrite)
        if resume:
            check_resumable(cfg, cfg.run_location())
            if check_store:  # never train on what cannot be read
                check_before_resume(cfg.run_location().uri)
    except (LocationError, ResumeError, RunFolderError, RunLockedError, RunExistsError, DamagedStoreError) as exc:
        raise ConfigError(str(exc)) from None
