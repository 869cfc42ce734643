"""`flexmarl cluster certs DIR`: the CA and per-role certificates a TLS-secured Dask cluster
needs (flexmarl_core/cluster/security.py). The local cluster of `flexmarl train` makes its
own, in memory; this is for machines you start yourself (docs/cluster.md, Security)."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_certs(args: argparse.Namespace) -> int:
    from flexmarl_core.cluster.security import make_certs

    folder = Path(args.folder)
    paths = make_certs(folder, days=args.days)
    print(f"wrote {len(paths)} files to {folder} (keys readable by you only; valid {args.days} days):")
    for p in paths:
        print(f"  {p.name}")
    print("Give each machine ca.pem and its role's pair only: the scheduler scheduler*.pem, each "
          "worker worker*.pem, the flow host client*.pem (`flexmarl train ... --set "
          "cluster.security.ca_file=ca.pem ...`). See docs/cluster.md, Security.")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="a cluster you start yourself: its TLS certificates")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    certs = csub.add_parser("certs", help="make a CA and a certificate + key per role (scheduler, worker, client)")
    certs.add_argument("folder", help="where to write them (an empty or new folder)")
    certs.add_argument("--days", type=int, default=365, help="how long the certificates are valid (default 365)")
    certs.set_defaults(fn=cmd_certs)
