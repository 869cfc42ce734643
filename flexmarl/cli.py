"""`flexmarl` command line.

    flexmarl train CONFIG [--set k=v ...]   train a team (Prefect flow on a local/remote Dask cluster)
    flexmarl train --resume RUN             continue an interrupted run from its last checkpoints
    flexmarl sft CONFIG [--out DIR]         warm-start checkpoints from demonstrations
    flexmarl store check PATH               list problems in a MEG Store; non-zero exit if any
    flexmarl store audit RUN_OR_STORE       exactly-once audit; exit 1 on duplicates/missing
    flexmarl report RUN [--compare RUN2]    draw timeline.png and curves.png of a run
    flexmarl server stop                    stop the Prefect server `train` started
    flexmarl humaneval [FILE] --completions JSONL | --canonical | --empty
                                            grade completions in the sandbox
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    """Usage errors are one `error:` line with exit 2, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _config(args: argparse.Namespace):  # noqa: ANN202 - avoids importing pydantic models at parse time
    from flexmarl_core.config import load_config

    return load_config(args.config, args.set)


def _resume_config(args: argparse.Namespace) -> None:
    """`train --resume RUN`: the run's own saved config is the config."""
    from flexmarl_core.config import ConfigError
    from flexmarl_core.worker import CONFIG_NAME

    if args.config is not None:
        raise ConfigError("give either CONFIG or --resume RUN, not both (a resumed run keeps its config)")
    saved = Path(args.resume) / CONFIG_NAME
    if not saved.exists():
        raise ConfigError(f"--resume {args.resume}: no {CONFIG_NAME} there (not a flexmarl run folder)")
    args.config = str(saved)


def cmd_train(args: argparse.Namespace) -> int:
    import os

    # Prefect's INFO lines (flow and task run states) stay in its API and UI; the terminal shows
    # the UI link, a line per iteration and the summary. Set before Prefect is imported.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    from flexmarl.console import console, summary_lines, summary_table
    from flexmarl.prefect_api import ensure_api, ui_url
    from flexmarl_core.config import ConfigError

    if args.resume:
        _resume_config(args)
    elif args.config is None:
        raise ConfigError("train: give a CONFIG file, or --resume RUN to continue a run")
    cfg = _config(args)  # validate before starting anything
    _preflight(cfg, resume=bool(args.resume))
    api, started = ensure_api(cfg.cluster.prefect_api_url)
    if started:
        console.print(f"started a local Prefect server at {ui_url(api)} (stop: flexmarl server stop)")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.train import train

    # Settings may have been loaded before ensure_api set the env var: pin the API explicitly.
    with temporary_settings(updates={PREFECT_API_URL: api}):
        state = train(args.config, args.set, progress=not args.no_progress, resume=bool(args.resume),
                      return_state=True)
    flow_run_id = getattr(state, "state_details", None) and state.state_details.flow_run_id
    if not state.is_completed():
        if flow_run_id:
            console.print(f"Prefect UI for this run: {ui_url(api)}/runs/flow-run/{flow_run_id}")
        console.print(f"[red]run failed: {state.message}")
        return 1
    out = state.result()
    console.print(summary_table(out["iterations"], out["summary"]))
    for line in summary_lines(out["summary"]):
        console.print(line, soft_wrap=True)  # a long path stays one line, not broken mid-word
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from flexmarl_core.config import ConfigError
    from flexmarl_core.plots import report

    for path in filter(None, [args.run, args.compare]):
        if not (Path(path) / "metrics" / "ops.jsonl").is_file():
            raise ConfigError(f"{path}: no metrics/ops.jsonl (not a finished or resumed flexmarl run folder)")
    for kind, path in report(args.run, args.compare, args.out).items():
        print(f"{kind}: {path}")
    return 0


def _preflight(cfg, *, resume: bool) -> None:  # noqa: ANN001 - an ExperimentConfig
    """Check what the config points at, now: a broken dataset row or reward callable, a missing
    warm-start checkpoint, an unreachable `cluster.address` or a resume that cannot work fails
    here, as a one-line error, before a Prefect server, a cluster or a half-made run folder
    exists."""
    from flexmarl_core.config import ConfigError
    from flexmarl_core.workloads import make_workload

    make_workload(cfg.workload, cfg.team)
    if cfg.train.init_from and not resume:
        root = Path(cfg.train.init_from)
        missing = [a.name for a in cfg.team.agents if not (root / a.name / "model.safetensors").is_file()]
        if missing:
            raise ConfigError(
                f"train.init_from {cfg.train.init_from!r}: no <agent>/model.safetensors for "
                f"{missing} (resolved: {root.absolute()}); point it at the output of `flexmarl sft`"
            )
    from flexmarl_core.cluster import check_address, check_worker_tags

    check_worker_tags(cfg)
    if cfg.cluster.address:
        check_address(cfg.cluster.address)
    from flexmarl_core.run import ResumeError, RunFolderError, check_resumable, check_run_folder

    try:
        if resume:
            check_resumable(cfg, cfg.resolved_run_dir().resolve())
        else:
            check_run_folder(cfg.resolved_run_dir().resolve())
    except (ResumeError, RunFolderError) as exc:
        raise ConfigError(str(exc)) from None


def cmd_sft(args: argparse.Namespace) -> int:
    from flexmarl_core.sft import run_sft

    cfg = _config(args)
    out = run_sft(cfg, out_dir=args.out)
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
        # says where the store is and which samples each iteration must hold).
        if "://" not in path and Path(path).is_dir() and not (Path(path) / MARKER).exists():
            from flexmarl_core.audit import audit_run

            uri, problems = audit_run(path)
        else:
            uri, problems = path, audit_store(path)
    except (OSError, StoreError) as exc:
        print(f"error: cannot audit {path}: {exc}", file=sys.stderr)
        return 2
    for p in problems:
        print(p)
    errors = sum(p.severity == "error" for p in problems)
    print(f"{uri}: {errors} error(s), {len(problems) - errors} warning(s)")
    return 1 if errors else 0


def cmd_humaneval(args: argparse.Namespace) -> int:
    """Grade a model's completions (or the canonical / empty bodies) on a HumanEval file."""
    import json
    from dataclasses import asdict

    from flexmarl_core.humaneval import HumanEvalError, grade_humaneval, humaneval_path

    try:
        source = args.completions or ("canonical" if args.canonical else "empty")
        path = humaneval_path(args.file)
        report = grade_humaneval(path, source, workers=args.workers)
    except HumanEvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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


def cmd_server_stop(args: argparse.Namespace) -> int:
    from flexmarl.prefect_api import stop_server

    print("stopped" if stop_server() else "no server started by flexmarl")
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
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sft", help="SFT warm start from demonstrations")
    with_config(s)
    s.add_argument("--out", default=None, help="output folder (default: <run_dir>/sft)")
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

    sv = sub.add_parser("server", help="the local Prefect server")
    sv_sub = sv.add_subparsers(dest="server_command", required=True)
    stop = sv_sub.add_parser("stop", help="stop the server `flexmarl train` started")
    stop.set_defaults(fn=cmd_server_stop)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from flexmarl_core.config import ConfigError
    from flexmarl_core.workloads import WorkloadError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, WorkloadError) as exc:  # bad input: the message names it, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
