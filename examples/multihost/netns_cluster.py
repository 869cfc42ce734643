"""Seven hosts on one Linux machine: the multi-machine setup of docs/cluster.md, to reproduce and
poke at before doing it for real. Each host is a network namespace with its own address on a
private bridge (tests/_netns.py), so nothing between them goes over loopback:

    store      moto's S3 server (:5000), holding the run folder and the MEG Store
    prefect    a Prefect API server (:4200) that demands an auth string
    scheduler  `dask scheduler --protocol tls` (:8786)
    worker-a   `dask worker tls://... --resources rollout=1,train=1` (no PYTHONPATH: the flow
    worker-b     ships the code, cluster.upload)
    flow-1     runs `flexmarl train configs/tiny.yaml` with the run on s3://
    flow-2     runs `flexmarl store audit` from object storage alone (a `--resume` would too)

The certificates come from `flexmarl cluster certs`; each host gets the CA's and its own
role's pair in its own HOME, and shares no folder with the others. Run as root from the
repository root, with the dev extra installed (moto):

    sudo .venv/bin/python examples/multihost/netns_cluster.py             # run, audit, tear down
    sudo .venv/bin/python examples/multihost/netns_cluster.py --keep      # then stay up until Enter
    sudo .venv/bin/python examples/multihost/netns_cluster.py --faults    # S3 behind a fault proxy

With --keep it prints how to open a shell on each host, with that host's environment
(`ip netns exec NS bash --rcfile HOME/env.sh`). Everything (namespaces, veths, the bridge, the
processes, the hosts' folders) is removed on exit, Ctrl-C included. The same topology, with a
worker killed and a resume from flow-2, is tests/slow/test_cluster_s3.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests._netns import HOSTS, Machine, S3Cluster, netns_available  # noqa: E402 - after the path

#: what `--faults` does to the hosts' S3 requests (tests/_fault_proxy.py)
FAULTS = {"503": 0.02, "drop": 0.01, "lost_reply": 0.01, "delay": 0.02}


def _run(m: Machine, *cmd: str) -> int:
    """`cmd` on `m`'s host, its output to this terminal."""
    print(f"\n[{m.name}] $ {shlex.join(cmd)}", flush=True)
    return subprocess.run([*m.host.wrap(), *cmd], cwd=m.cwd, env=m.env, check=False).returncode


def _shells(cluster: S3Cluster) -> None:
    print("\nA shell on a host, with its environment (as root):")
    for name in HOSTS:
        m = cluster[name]
        rc = m.home / "env.sh"
        rc.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in m.env.items()) + f"cd {m.cwd}\n")
        print(f"  {name:<10} {m.host.ip:<14} ip netns exec {m.host.ns} bash --rcfile {rc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"), help="the team to train")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--bucket", default="flexmarl-hosts")
    ap.add_argument("--faults", action="store_true", help="put the seeded S3 fault proxy in front of the store")
    ap.add_argument("--keep", action="store_true", help="stay up after the run until Enter")
    args = ap.parse_args(argv)
    reason = netns_available()
    if reason:
        print(f"netns_cluster: {reason}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("moto") is None:
        print("netns_cluster: moto is not installed (the dev extra has it)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="flexmarl-hosts-"))  # 0700: it holds keys and the auth string
    cluster = S3Cluster(root, args.bucket, faults=FAULTS if args.faults else None)
    try:
        print("starting the hosts (Prefect's server takes 10-30 s) ...", flush=True)
        cluster.start()
        for name in HOSTS:
            print(f"  {name:<10} {cluster[name].host.ip}")
        print(f"  S3 {cluster.s3_url}, Prefect API {cluster.api}, scheduler {cluster.address}")
        run = f"s3://{args.bucket}/runs/netns"
        sets = [f"run_dir={run}", *cluster.flow_sets(), f"train.iterations={args.iterations}",
                "train.evaluate=false", f"cluster.upload=[{REPO}]"]
        rc = _run(cluster["flow-1"], sys.executable, "-m", "flexmarl.cli", "train", args.config,
                  *[x for s in sets for x in ("--set", s)], "--no-progress")
        rc = rc or _run(cluster["flow-2"], sys.executable, "-m", "flexmarl.cli", "store", "audit", run)
        if args.keep:
            _shells(cluster)
            input("\nPress Enter to take everything down. ")
        return rc
    except KeyboardInterrupt:
        return 130
    finally:
        print("taking the hosts down ...", flush=True)
        try:
            cluster.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
