"""`flexmarl` command line.

    flexmarl train CONFIG [--set k=v ...]   train a team (Prefect flow on a local/remote Dask cluster)
    flexmarl train --resume RUN             continue an interrupted run from its last checkpoints
    flexmarl train CONFIG --overwrite       start afresh over the run in the config's run folder
    flexmarl sft CONFIG [--out DIR]         warm-start checkpoints from demonstrations
    flexmarl store check PATH               list problems in a MEG Store; non-zero exit if any
    flexmarl store audit RUN_OR_STORE       exactly-once audit; exit 1 on duplicates/missing
    flexmarl store repair RUN               set damaged fragments aside; a resume writes them again, or they are lost
    flexmarl report RUN [--compare RUN2]    draw timeline.png and curves.png of a run
    flexmarl server status                  the local Prefect servers flexmarl started
    flexmarl server stop [--all]            stop this PREFECT_HOME's (--all: every one)
    flexmarl server start                   start this PREFECT_HOME's again, on its last port
    flexmarl simulate CONFIG --cluster C    simulated cluster: Table 2/3 of the co-design (simulated)
    flexmarl simulate --calibrate RUN       fit the cost model from a run's op log and replay it
    flexmarl cluster certs DIR              a CA and TLS certificates for a cluster you start yourself
    flexmarl humaneval [FILE] --completions JSONL | --canonical | --empty
                                            grade completions in the sandbox
    flexmarl export RUN --out DIR           each agent as a Hugging Face folder (from_pretrained)
    flexmarl eval RUN [--version N]         the team's held-out accuracy at a kept version
    flexmarl serve RUN|DIR [--port P]       the team behind an OpenAI-compatible endpoint
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from flexmarl import cluster_cli
from flexmarl.simulate_cli import cmd_simulate
from flexmarl_core.config.checks import ConfigError  # light: no pydantic models at parse time


class _Parser(argparse.ArgumentParser):
    """Usage errors are one `error:` line with exit 2, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


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

    _cluster_checks(cfg)
    # The local cluster starts now, its workers importing torch on the other core while this
    # process imports its own and runs the checks below; a launch they refuse stops it again.
    start_ahead(cfg.cluster)
    try:
        return _train(args, cfg)
    finally:
        close_ahead()


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
    except ConfigError as exc:  # one line that names the config file too
        said = str(exc)
        raise ConfigError(said if args.config in said else f"{args.config}: {said}") from None
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
        said = str(exc)
        raise ConfigError(said if args.config in said else f"{args.config}: {said}") from None
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


def cmd_report(args: argparse.Namespace) -> int:
    from flexmarl_core.driver.plots import report

    for path in filter(None, [args.run, args.compare]):
        if not (Path(path) / "metrics" / "ops.jsonl").is_file():
            raise ConfigError(f"{path}: no metrics/ops.jsonl (not a finished or resumed flexmarl run folder)")
    _close_left_open(args.run)
    try:
        paths = report(args.run, args.compare, args.out)
    except OSError as exc:
        raise ConfigError(f"report: cannot write the pictures: {exc}") from None
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


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


def cmd_sft(args: argparse.Namespace) -> int:
    from flexmarl_core.driver.sft import run_sft

    cfg = _config(args)
    out = run_sft(cfg, out_dir=args.out, keep_checks=args.keep_checks, resume_from=args.resume_from)
    print(f"SFT checkpoints in {out['out_dir']}: held-out accuracy {out['accuracy']:.3f} "
          f"after {out['steps']} steps")
    return 0


def cmd_store_check(args: argparse.Namespace) -> int:
    from storage.check import main as check_main

    extra = ["--strict"] if args.strict else []
    if args.stale_after is not None:
        extra += ["--stale-after", str(args.stale_after)]
    return check_main([args.path, *extra])


def cmd_store_audit(args: argparse.Namespace) -> int:
    """Exit 0 when every sample is stored exactly once, 1 otherwise (2: not a run or store)."""
    from storage import StoreError, audit_store
    from storage.store import MARKER

    path = args.path
    try:
        # A local folder that is not itself a store is taken for a run folder (its config
        # says where the store is and which samples each iteration must hold); so is a URI
        # that holds a run's config.
        from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation

        loc = RunLocation(path)
        run_like = Path(path).is_dir() if loc.local else loc.is_file(CONFIG_NAME)
        if run_like and not loc.exists(MARKER):
            from flexmarl_core.driver.audit import audit_run

            run = audit_run(path)
            uri, problems = run.uri, run.problems
            checked = (f"checked {len(run.iterations)} completed iteration(s), {run.samples} samples, "
                       f"{run.ops} ops and {run.rows} iteration rows: {run.verdict()}")
            _stale_owner(loc)
        else:
            uri, problems = path, audit_store(path)
            checked = ""
    except (OSError, StoreError) as exc:
        print(f"error: cannot audit {path}: {exc}", file=sys.stderr)
        return 2
    for p in problems:
        print(p)
    errors = sum(p.severity == "error" for p in problems)
    if checked:
        print(checked)
    print(f"{uri}: {errors} error(s), {len(problems) - errors} warning(s)")
    return 1 if errors else 0


def cmd_store_repair(args: argparse.Namespace) -> int:
    """Set a run's damaged store fragments aside; rewind the ops that write each again, or
    record its samples as lost (trained on before the damage, their weights gone)."""
    from flexmarl_core.driver.repair import DamagedStoreError, repair_run
    from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation

    if not RunLocation(args.run).is_file(CONFIG_NAME):
        raise ConfigError(f"store repair {args.run}: no {CONFIG_NAME} there (give a run folder)")
    try:
        fixed = repair_run(args.run)
    except DamagedStoreError as exc:
        raise ConfigError(str(exc)) from None
    for rep in fixed:
        d = rep.damage
        mb = "every micro-batch (compacted)" if d.mb == -1 else f"micro-batch {d.mb}"
        what = (f"{len(rep.rewound)} ops run again to write it" if rep.outcome == "rewritten" else
                f"lost: {len(rep.lost)} samples{' (their rewards and consumption)' if d.table == 'status' else ''}, "
                "trained on before the damage, whose weights the run no longer keeps")
        print(f"set aside {d.problem.path} ({d.problem.kind}): {d.table} of {d.agent}, iteration {d.iteration}, "
              f"{mb}; {what}")
    again = sum(rep.outcome == "rewritten" for rep in fixed)
    lost = sum(len(rep.lost) for rep in fixed)
    print(f"{args.run}: {len(fixed)} damaged file(s) set aside" + (": nothing to repair" if not fixed else (
        f"; `flexmarl train --resume {args.run}` writes {again} of them again" if again else "")
        + (f"; {lost} samples lost, recorded in {RunLocation(args.run).display('repairs.jsonl')} "
           f"(`flexmarl store audit {args.run}` names them)" if lost else "")))
    return 0


def _stale_owner(loc) -> None:  # noqa: ANN001 - a RunLocation
    """A run folder whose owner died: say so, and end what its attempts left open in the API."""
    from flexmarl_core.driver.lease import read_lease

    lease = read_lease(loc)
    if lease is not None and not lease.alive():
        print(f"{loc.uri}: its run stopped without ending ({lease.owner()} is gone): "
              f"`flexmarl train --resume {loc.uri}` continues it")
    _close_left_open(loc.uri)


def _close_left_open(run: str) -> None:
    """End the flow and task runs the run's attempts left open in the Prefect API (a killed
    run's, or one whose API was away at its end): `tasks/leftovers.py`."""
    from flexmarl_core.runfiles.location import LEASE_NAME, RunLocation
    from tasks.leftovers import RECORD, close_for_command

    loc = RunLocation(run)
    if loc.exists(RECORD) or loc.exists(LEASE_NAME):
        ended = close_for_command(loc)
        if ended:
            print(f"{run}: ended {ended} Prefect flow and task runs its attempts left open")


def cmd_humaneval(args: argparse.Namespace) -> int:
    """Grade a model's completions (or the canonical / empty bodies) on a HumanEval file."""
    from flexmarl_core.sandbox import SandboxError
    from flexmarl_core.workloads.humaneval import HumanEvalError, grade_humaneval, humaneval_path

    try:
        source = args.completions or ("canonical" if args.canonical else "empty")
        path = humaneval_path(args.file)
        report = grade_humaneval(path, source, workers=args.workers)
    except HumanEvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SandboxError as exc:  # no verdict at all: never a column of zeros
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for task_id, v in report.verdicts.items():
        if v.reason != "passed" and args.verbose:
            print(f"{task_id}: {v.reason}: {v.detail}")
    print(f"{path}: {report.passed}/{report.total} passed ({report.passed / report.total:.1%}); "
          f"reasons: {report.reasons()}")
    if args.json:
        out = {"file": str(path), "completions": source, "passed": report.passed,
               "total": report.total, "tasks": {k: asdict(v) for k, v in report.verdicts.items()}}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    """`server status`, `server stop [--all]`, `server start` (flexmarl/servers.py)."""
    from flexmarl import servers
    from flexmarl.prefect_api import _home, auth_file, local_server, stop_server, ui_url

    if args.server_command == "status":
        print("\n".join(servers.status_lines()))
    elif args.server_command == "stop":
        print("\n".join(servers.stop_all()) if args.all else stop_server())
    else:
        url, started = local_server(_home(), join=False)
        print(f"{'started' if started else 'already running:'} the local Prefect server at {ui_url(url)} "
              f"(Prefect home {_home()}){servers.idle_note(url)}")
        print(f"its auth string (for PREFECT_API_AUTH_STRING and the UI's login) is in {auth_file(_home())}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flexmarl", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", help="experiment YAML (see configs/)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set batch.group_size=8")

    t = sub.add_parser("train", help="train a team")
    t.add_argument("config", nargs="?", default=None, help="experiment YAML (see configs/)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set batch.group_size=8")
    t.add_argument("--resume", metavar="RUN", default=None,
                   help="continue an interrupted run from its folder (its own config, last checkpoints)")
    t.add_argument("--overwrite", action="store_true",
                   help="start afresh over the run already in the run folder (its files are deleted)")
    t.add_argument("--skip-check", action="store_true",
                   help="--resume without checking the store first (a damaged file then fails the op that reads it)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument("--debug", action="store_true",
                   help="on failure, the traceback too; Prefect's and Dask's warnings on the terminal")
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sft", help="SFT warm start from demonstrations")
    with_config(s)
    s.add_argument("--out", default=None, help="output folder (default: <run_dir>-sft)")
    s.add_argument("--keep-checks", action="store_true",
                   help="also save the team at every held-out check as OUT/step-<N>")
    s.add_argument("--resume-from", metavar="CKPT", default=None,
                   help="continue from a team `flexmarl sft` saved (OUT or OUT/step-<N>) at its step")
    s.set_defaults(fn=cmd_sft)

    st = sub.add_parser("store", help="MEG Store tools")
    st_sub = st.add_subparsers(dest="store_command", required=True)
    chk = st_sub.add_parser("check", help="list problems in a store; exit 1 if any")
    chk.add_argument("path", help="store path or URI")
    chk.add_argument("--strict", action="store_true", help="warnings fail too")
    chk.add_argument("--stale-after", type=float, default=None, metavar="S",
                     help="staging files older than S seconds count as stale")
    chk.set_defaults(fn=cmd_store_check)

    aud = st_sub.add_parser(
        "audit", help="exactly-once audit: duplicates, orphan status rows, missing samples; "
        "exit 1 if any")
    aud.add_argument("path", help="run folder (also checks each completed iteration's "
                     "expected samples) or store path/URI")
    aud.set_defaults(fn=cmd_store_audit)
    rep = st_sub.add_parser("repair", help="set a run's damaged store fragments aside: a resume writes them "
                            "again, or, trained on and their weights gone, they are recorded as lost")
    rep.add_argument("run", help="run folder")
    rep.set_defaults(fn=cmd_store_repair)

    sim = sub.add_parser("simulate", help="simulate a cluster: the real orchestrator on a virtual clock")
    sim.add_argument("config", nargs="?", default=None, help="experiment YAML (e.g. configs/sim/math-3x14b.yaml)")
    sim.add_argument("--cluster", default=None, help="cluster description (e.g. configs/sim/paper-48x16.yaml)")
    sim.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, or a cluster field with the sim. prefix")
    sim.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    sim.add_argument("--timeline", default=None, metavar="PNG",
                     help="write the co-design's timeline (and PNG-sync for the baseline)")
    sim.add_argument("--calibrate", default=None, metavar="RUN",
                     help="fit the cost model from a finished run's op log and replay its config")
    sim.add_argument("--sweep", default=None, metavar="KEY=V1,V2|switches",
                     help="what-if sweep as a Prefect flow, one point per task on Dask")
    sim.set_defaults(fn=cmd_simulate)  # flexmarl/simulate_cli.py
    cluster_cli.add_parser(sub)  # flexmarl cluster certs

    r = sub.add_parser("report", help="draw a run's timeline.png and curves.png")
    r.add_argument("run", help="run folder (finished or resumed)")
    r.add_argument("--compare", metavar="RUN2", default=None,
                   help="another run to stack on the timeline (e.g. the synchronous baseline)")
    r.add_argument("--out", default=None, help="folder for the PNGs (default: the run folder)")
    r.set_defaults(fn=cmd_report)

    he = sub.add_parser("humaneval", help="grade completions on a HumanEval file in the sandbox")
    he.add_argument("file", nargs="?", default=None,
                    help="HumanEval-format JSONL(.gz) or its folder (default: "
                    "$FLEXMARL_DATA/humaneval/HumanEval.jsonl.gz)")
    which = he.add_mutually_exclusive_group(required=True)
    which.add_argument("--completions", metavar="JSONL",
                       help='{"task_id", "completion"} rows, e.g. from your own model')
    which.add_argument("--canonical", action="store_true", help="the file's canonical solutions")
    which.add_argument("--empty", action="store_true", help="empty bodies (the prompt alone)")
    he.add_argument("--workers", type=int, default=None, help="programs at once (default: cores)")
    he.add_argument("--json", metavar="OUT", default=None, help="write every task's verdict")
    he.add_argument("-v", "--verbose", action="store_true", help="a line per failed task")
    he.set_defaults(fn=cmd_humaneval)

    sv = sub.add_parser("server", help="the local Prefect servers flexmarl started")
    sv_sub = sv.add_subparsers(dest="server_command", required=True)
    sv_sub.add_parser("status", help="each one: port, Prefect home, pid, in use or idle").set_defaults(fn=cmd_server)
    stop = sv_sub.add_parser("stop", help="stop the server `flexmarl train` started in this PREFECT_HOME")
    stop.add_argument("--all", action="store_true", help="stop every one `server status` lists")
    stop.set_defaults(fn=cmd_server)
    sv_sub.add_parser("start", help="start this PREFECT_HOME's server again, on its last port").set_defaults(
        fn=cmd_server)

    # After training: each command's code lives in its own module.
    from flexmarl import evaluate, export, serve

    for command in (export, evaluate, serve):
        command.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from flexmarl_core.workloads import WorkloadError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, WorkloadError) as exc:  # bad input: the message names it, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:  # the exit's collections skip what the command made: 1-2 s after torch's imports
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
