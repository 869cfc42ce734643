"""A run on machines that share nothing but S3, each a host of its own: a Linux network
namespace with its own address on a private bridge (`tests._netns`), so every connection between
them crosses a network interface, none goes over a shared loopback. The hosts: the object
store (moto's S3 server behind a seeded fault proxy that answers some requests with 503s, drops
connections before or after forwarding them and delays them: `tests._fault_proxy`; the store
and run location retry, `storage.retry`), a Prefect API server demanding an auth string, a Dask
scheduler and two workers started with Dask's own command lines over TLS (`dask scheduler
--protocol tls`, `dask worker --resources ...`, certificates from `flexmarl cluster certs`), and
two flow hosts; each process has its own empty cwd, HOME, TMPDIR and flexmarl cache, and its
own copy of its certificate.

The workers get flexmarl's code from the flow through Dask (`cluster.upload` of this checkout:
they have no PYTHONPATH to it), the scheduler and the flow hosts through PYTHONPATH; the
third-party packages come from the same venv, as they would from an image. `flexmarl train`
on flow-1, with `cluster.address=tls://...`, `cluster.security`'s files and an `s3://` run_dir,
runs two iterations while a fault marker on S3 makes a worker SIGKILL itself mid-rollout (its
nanny restarts it) and another fails a step for good (the flow run fails); `--resume` then
continues from flow-2, which has never seen the run, i.e. from object storage alone, and
`flexmarl store audit` finds every sample stored exactly once. A client without the cluster's
certificates cannot use the scheduler, and the Prefect API answers 401 without the auth string.

Needs root and iproute2 (skips saying which is missing). The same hosts for a manual run:
examples/multihost/netns_cluster.py.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from flexmarl_core.cluster.security import make_certs
from flexmarl_core.cluster.workers import workers_info
from tests._netns import WORKERS, S3Cluster, netns_available
from tests._s3 import require_moto, s3_kwargs

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
BUCKET = "flexmarl-cluster"
RUN = f"s3://{BUCKET}/runs/tiny"
AGENTS = ("planner", "solver", "verifier")
KILL_OP = "rollout[solver] it=0 mb=1"  # a worker dies in the middle of iteration 0
FAIL_OP = "step[planner] it=1"  # fails beyond its retries: the first flow run fails there
#: what the fault proxy does to the machines' S3 requests (the test's own go to moto directly)
S3_FAULTS = {"503": 0.02, "drop": 0.01, "lost_reply": 0.01, "delay": 0.02}

#: Run on flow-1: the scheduler's port answers there, yet no client without a certificate of
#: the cluster's CA gets in (Dask with none, plain tcp, another CA's; TLS trusting the CA but
#: showing no certificate), and the Prefect API answers only the auth string.
PROBE = r"""
import base64, json, os, socket, ssl, sys, urllib.error, urllib.request
from pathlib import Path
from distributed import Client
from distributed.security import Security

address, api, other = sys.argv[1], sys.argv[2], Path(sys.argv[3])
host, port = address.split("://")[1].rsplit(":", 1)
socket.create_connection((host, int(port)), timeout=30).close()
ca = str(Path.home() / "tls" / "ca.pem")  # the cluster's CA certificate: public, it admits nobody
# trusts the scheduler, shows a certificate another CA signed: the scheduler must refuse it
stranger = Security(require_encryption=True, tls_ca_file=ca, tls_client_cert=str(other / "client.pem"),
                    tls_client_key=str(other / "client-key.pem"))
out = {}
for name, addr, sec in (("no certificate", address, None), ("plain tcp", f"tcp://{host}:{port}", None),
                        ("another CA", address, stranger)):
    try:
        Client(addr, timeout=5, security=sec).close()
        out[name] = "connected"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"[:300]
# TLS that trusts the cluster's CA (public) but shows no certificate: the scheduler demands one.
ctx = ssl.create_default_context(cafile=ca)
ctx.check_hostname = False
try:
    with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=30)) as s:
        s.sendall(b"x")
        out["CA only"] = f"read {s.recv(1)!r}"
except (ssl.SSLError, OSError) as e:
    out["CA only"] = f"{type(e).__name__}: {e}"[:300]

def get(auth):
    headers = {} if auth is None else {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    try:
        with urllib.request.urlopen(urllib.request.Request(api + "/admin/version", headers=headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

out["prefect"] = {"none": get(None), "wrong": get("guess"), "right": get(os.environ["PREFECT_API_AUTH_STRING"])}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Cluster]:
    require_moto()
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    cluster = S3Cluster(tmp_path_factory.mktemp("hosts"), BUCKET, faults=S3_FAULTS, seed=0, delay_s=0.2).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _worker_pids(hosts: S3Cluster) -> set[int]:
    with hosts.client() as c:
        return set(c.run(os.getpid).values())


def _code_origin(hosts: S3Cluster) -> set[str]:
    """Where each worker imported flexmarl_core from."""

    def origin() -> str:
        import flexmarl_core

        return flexmarl_core.__file__

    with hosts.client() as c:
        return set(c.run(origin).values())


def _log(fs: pafs.S3FileSystem, stem: str) -> list[str]:
    """A run log on S3: its parts in order (`MetricsWriter`), no whole file."""
    folder = f"{BUCKET}/runs/tiny/metrics"
    assert fs.get_file_info(f"{folder}/{stem}.jsonl").type == pafs.FileType.NotFound
    parts = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(f"{folder}/{stem}")))
    assert parts, stem
    return [x for p in parts for x in fs.open_input_stream(p).read().decode().splitlines()]


def _flow_run_states(hosts: S3Cluster) -> list[str]:
    """The state types of the top-level flow runs the Prefect host holds, oldest first (a
    POST: the server demands a CSRF token as well as the auth string)."""
    auth = {"Authorization": "Basic " + base64.b64encode(hosts.auth.encode()).decode()}
    req = urllib.request.Request(f"{hosts.api}/csrf-token?client=multihost-test", headers=auth)
    with urllib.request.urlopen(req, timeout=30) as r:
        token = json.load(r)["token"]
    req = urllib.request.Request(f"{hosts.api}/flow_runs/filter", data=b"{}", method="POST", headers={
        **auth, "Content-Type": "application/json", "Prefect-Csrf-Token": token,
        "Prefect-Csrf-Client": "multihost-test"})
    with urllib.request.urlopen(req, timeout=30) as r:
        runs = [x for x in json.load(r) if x["parent_task_run_id"] is None]  # not the iterations' subflows
    return [x["state_type"] for x in sorted(runs, key=lambda x: x["start_time"])]


def test_train_on_separate_hosts_with_the_run_on_s3(hosts: S3Cluster) -> None:
    flow, flow2 = hosts["flow-1"], hosts["flow-2"]
    # Every process is on its own host: the scheduler knows the workers by their hosts' addresses.
    with hosts.client() as c:
        seen = {a.split("://")[1].rsplit(":", 1)[0] for a in workers_info(c)}
    assert seen == {hosts[w].host.ip for w in WORKERS}, seen

    # The probe mostly waits on its clients' timeouts: it runs beside the first flow run.
    make_certs(flow.tmp / "other-ca")  # a set of flow-1's own, of a CA the cluster never saw
    probe = flow.popen(sys.executable, "-c", PROBE, hosts.address, hosts.api, str(flow.tmp / "other-ca"),
                       log="probe.log")

    fs = pafs.S3FileSystem(**s3_kwargs(hosts.s3))
    faults = f"{BUCKET}/runs/tiny.faults"
    with fs.open_output_stream(f"{faults}/kill@{KILL_OP}"):
        pass
    with fs.open_output_stream(f"{faults}/fail@{FAIL_OP}") as f:
        f.write(b"5")  # step has 1 retry: two attempts fail, the op fails, the flow run fails
    before = _worker_pids(hosts)

    sets = [f"run_dir={RUN}", *hosts.flow_sets(), "cluster.prefect_lean=true", "train.evaluate=false",
            f"cluster.upload=[{REPO}]"]
    args = [x for s in sets for x in ("--set", s)]
    first = flow.run(sys.executable, "-m", "flexmarl.cli", "train", TINY, *args, "--no-progress", timeout=600)
    out = first.stdout + first.stderr
    assert first.returncode == 1, out[-3000:]
    assert FAIL_OP in out and "injected fault" in out, out[-3000:]
    assert probe.wait(timeout=300) == 0, flow.log("probe.log")
    found = json.loads(flow.log("probe.log").splitlines()[-1])
    assert all(found[k] != "connected" for k in ("no certificate", "plain tcp", "another CA")), found
    assert found["CA only"].startswith(("SSLError", "SSLEOFError", "ConnectionResetError")), found
    assert found["prefect"] == {"none": 401, "wrong": 401, "right": 200}, found

    # The worker that ran KILL_OP died (SIGKILL) and its nanny started a new process.
    marks = {i.base_name for i in fs.get_file_info(pafs.FileSelector(faults))}
    assert f"kill@{KILL_OP}" not in marks, marks
    assert _worker_pids(hosts) != before
    ops = [json.loads(x) for x in _log(fs, "ops")]
    assert KILL_OP in {o["op"] for o in ops}
    # The workers run the shipped code: a zip in their own Dask folder, not this checkout.
    origins = _code_origin(hosts)
    assert origins and all(".zip" in o and str(REPO) not in o for o in origins), origins
    assert all(f"sync[{a}] it=0" in {o["op"] for o in ops} for a in AGENTS)
    fs.delete_file(f"{faults}/fail@{FAIL_OP}")

    # Resume from another host that has never seen the run: the config, op log, checkpoints
    # and weights come from S3 only. The config names the certificate as ~/tls/...: flow-2's
    # own copy (flow-1's is moved away, so reading it would fail).
    saved = fs.open_input_stream(f"{BUCKET}/runs/tiny/config.yaml").read().decode()
    assert "~/tls/client.pem" in saved and str(flow.home) not in saved, saved
    (flow.home / "tls").rename(flow.home / "tls.gone")
    resumed = flow2.run(sys.executable, "-m", "flexmarl.cli", "train", "--resume", RUN, "--no-progress", timeout=600)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    rows = _log(fs, "iterations")
    assert [json.loads(r)["iteration"] for r in rows] == [0, 1]
    for a in AGENTS:
        assert fs.get_file_info(f"{BUCKET}/runs/tiny/weights/{a}/v2.safetensors").type == pafs.FileType.File
    # Ops the first attempt finished were not run again, except training of the iteration
    # whose step had not happened (its gradients died with that attempt).
    names = [json.loads(x)["op"] for x in _log(fs, "ops")]
    repeated = {n for n in names if names.count(n) > 1}
    assert all(n.startswith("train[") and " it=1 " in n + " " for n in repeated), repeated
    # Weight pushes: syncs broadcast to the other workers' engines. Whether a later rollout
    # then lands on a worker the push reached is the router's choice among equally loaded
    # instances, so that is not asserted here (it failed once in a loaded suite run).
    rows = [json.loads(x) for x in _log(fs, "ops")]
    assert any(v >= 1 for r in rows for k, v in r.items() if k.endswith("/sync/push_targets")), rows

    audit = flow2.run(sys.executable, "-m", "flexmarl.cli", "store", "audit", RUN, timeout=300)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "0 error(s)" in audit.stdout

    # Both flow runs reported to the Prefect host: the failed first one and the resumed one.
    assert _flow_run_states(hosts) == ["FAILED", "COMPLETED"]

    # Every kind of S3 fault happened to the run's requests, and was survived.
    injected = hosts.injected()
    assert all(injected.get(k, 0) > 0 for k in S3_FAULTS), injected

    # S3 is the only thing shared: no run file ever landed in a worker's or the scheduler's
    # own folders (they hold Dask's scratch space and their own model caches only).
    run_files = {"config.yaml", "ops.jsonl", "iterations.jsonl", ".flexmarl-run"}
    for m in [hosts["scheduler"], *(hosts[w] for w in WORKERS)]:
        leaked = [p for p in m.files() if p.name in run_files or p.suffix in (".state", ".parquet")
                  or (p.suffix == ".safetensors" and "weights" in p.parts)]
        assert not leaked, leaked
