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
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from flexmarl import cluster_cli
from flexmarl.simulate_cli import cmd_simulate
from flexmarl.train_cli import _config, cmd_train
from flexmarl_core.config.checks import ConfigError  # light: no pydantic models at parse time


class _Parser(argparse.ArgumentParser):
    """Usage errors are one `error:` line with exit 2, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


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


def cmd_sft(args: argparse.Namespace) -> int:
    from flexmarl_core.driver.sft import ResumeStateError, run_sft

    cfg = _config(args)
    try:
        out = run_sft(cfg, out_dir=args.out, keep_checks=args.keep_checks, resume_from=args.resume_from)
    except ResumeStateError as exc:  # a --resume-from folder that is not a saved team: named
        print(f"error: {exc}", file=sys.stderr)
        return 2
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


def entry() -> NoReturn:
    """The `flexmarl` command: `main`, then an exit whose collections skip what the command
    made (1-2 s after torch's imports). Not in `main`, which tests call in their own process."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
