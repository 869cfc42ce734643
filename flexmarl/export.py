"""`flexmarl export RUN --out DIR`: each agent of a trained run as a Hugging Face folder that
`from_pretrained` loads (`flexmarl_core/export/folder.py`)."""

from __future__ import annotations

import argparse
import sys

from flexmarl_core.config.checks import ConfigError


def version_arg(text: str) -> int | str:
    """`--version`: a weights version (an integer >= 0) or `latest`."""
    if text == "latest":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version: give an integer >= 0 or latest") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version: give an integer >= 0 or latest")
    return v


def cmd_export(args: argparse.Namespace) -> int:
    from flexmarl_core.export.folder import export_team
    from flexmarl_core.export.versions import RunReadError, TrainedRun

    try:
        run = TrainedRun.open(args.run)
        versions = export_team(run, args.out, agents=args.agent or None, version=args.version,
                               adapter=args.adapter, overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    except RunReadError as exc:
        raise ConfigError(str(exc)) from None
    live = run.training()
    if live is not None:
        print(f"note: {args.run} is still training ({live.owner()}); exported the versions it keeps for good",
              file=sys.stderr)
    print(f"exported {len(versions)} agent(s) of {args.run} to {args.out}: "
          + ", ".join(f"{a} v{v}" for a, v in versions.items()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """The `export` subcommand, in `flexmarl.cli`'s parser."""
    ex = sub.add_parser("export", help="each agent of a run as a Hugging Face folder (from_pretrained loads it)")
    ex.add_argument("run", help="run folder or URI (s3://...)")
    ex.add_argument("--out", required=True, help="the folder to write: OUT/<agent>/ per agent")
    ex.add_argument("--agent", action="append", default=[], metavar="A", help="only this agent (repeatable)")
    ex.add_argument("--version", type=version_arg, default="latest", metavar="N|latest",
                    help="weights version (N optimizer steps; default: the newest every agent has)")
    ex.add_argument("--adapter", action="store_true",
                    help="LoRA agents as PEFT adapter folders naming their base (default: merged into it)")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT if it is an earlier export")
    ex.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="split model.safetensors into shards of at most SIZE (default 5GB)")
    ex.set_defaults(fn=cmd_export)
