"""`flexmarl eval RUN`: the team's greedy held-out accuracy (and mean reward per agent) at any
version the run keeps, on the workload's held-out set or a file, through the run's own team
(YAML or program): the evaluation the run itself makes at its end (`stages/evaluate.py`); or
through another program (`--program`) calling the same agents."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flexmarl.export import version_arg
from flexmarl_core.config.checks import ConfigError


def cmd_eval(args: argparse.Namespace) -> int:
    from flexmarl_core.driver.evaluate import problems_from_file
    from flexmarl_core.export.versions import RunReadError, TrainedRun
    from flexmarl_core.runtime.worker import context
    from flexmarl_core.stages.evaluate import evaluate

    try:
        run = TrainedRun.open(args.run)
        versions = run.resolve(run.agents(), args.version)
    except RunReadError as exc:
        raise ConfigError(str(exc)) from None
    if args.heldout is not None and args.heldout < 1:
        raise ConfigError(f"--heldout {args.heldout}: give a number of problems >= 1")
    ctx = context(run.where)
    if args.data is not None:
        problems, what = problems_from_file(ctx.workload, args.data), f"the rows of {args.data}"
    else:
        n = args.heldout or run.cfg.workload.heldout_size
        problems = ctx.workload.problems("heldout", n, seed=run.cfg.seed)
        what = ctx.workload.heldout_description(n)
    version = max(versions.values())
    own_team = args.program is None
    if args.program is not None:
        from flexmarl_core.stages.evaluate import through_program

        try:
            spec = through_program(run.cfg.team, args.program).program
        except ValueError as exc:
            raise ConfigError(f"--program: {_first_error(exc)}") from None
        own_team = spec == run.cfg.team.program
        what += f", through {spec}"
    res = evaluate(run.where, version, versions=versions, problems=problems, program=args.program)
    rewards = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in res.items() if k.startswith("heldout_reward/"))
    print(f"{args.run}: " + ", ".join(f"{a} v{v}" for a, v in versions.items()) + f"; {what}")
    print(f"held-out accuracy {res['heldout_accuracy']:.4f} on {res['heldout_n']} problems; "
          f"mean reward per agent: {rewards}")
    out: dict[str, Any] = {"run": run.where, "versions": versions, "set": what, **res}
    own = run.heldout(version) if own_team and args.data is None and args.heldout in (
        None, run.cfg.workload.heldout_size) else {}
    if own and all(v == version for a, v in versions.items() if run.cfg.agent(a).trainable):
        same = own["heldout_accuracy"] == res["heldout_accuracy"]
        print(f"the run's own evaluation of this version and set: {own['heldout_accuracy']:.4f}"
              + (" (the same)" if same else " (different: greedy decodes on another machine or torch build can differ)"))
        out["run_measured"] = own
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _first_error(exc: ValueError) -> str:
    """pydantic's message for the one field that failed, on one line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in errors())
    return str(exc).replace("\n", " ")


def register(sub: argparse._SubParsersAction) -> None:
    """The `eval` subcommand, in `flexmarl.cli`'s parser."""
    ev = sub.add_parser("eval", help="the team's held-out accuracy at a version the run keeps")
    ev.add_argument("run", help="run folder or URI (s3://...)")
    ev.add_argument("--version", type=version_arg, default="latest", metavar="N|latest",
                    help="weights version (default: the newest every agent has; frozen agents: 0)")
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--heldout", type=int, default=None, metavar="N",
                       help="the first N problems of the workload's held-out set (default: workload.heldout_size)")
    which.add_argument("--data", default=None, metavar="FILE",
                       help="JSONL or Parquet rows to evaluate on (input, answer; or the run's workload.fields)")
    ev.add_argument("--program", default=None, metavar="FILE:FUNCTION",
                    help="answer through this program (path/to/file.py:team or module:team) calling the "
                    "run's agents by name, instead of the run's own team")
    ev.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON")
    ev.set_defaults(fn=cmd_eval)
