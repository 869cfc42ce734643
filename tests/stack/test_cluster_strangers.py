"""Nobody without the cluster's certificate drives it: not the session's TLS cluster (made from
`flexmarl cluster certs` files, as a user's own machines are), not the local cluster a plain
`flexmarl train` starts (certificates made for the run, in memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from flexmarl_core.cluster import start_cluster, workers_info
from flexmarl_core.config import ClusterConfig

# A stranger on the same machine: no TLS settings at all, then a certificate of its own CA.
STRANGER = textwrap.dedent("""
    import json, sys
    import distributed
    from distributed.security import Security
    out = {}
    tls, tcp = sys.argv[1], sys.argv[1].replace("tls://", "tcp://")
    for name, addr, sec in (("plain-tls", tls, None), ("plain-tcp", tcp, None),
                            ("own-ca", tls, Security.temporary())):
        try:
            with distributed.Client(addr, timeout=5, security=sec) as c:
                out[name] = "connected: " + str(len(c.scheduler_info()["workers"])) + " workers"
        except Exception as exc:
            out[name] = "refused: " + type(exc).__name__
    print(json.dumps(out))
""")


def _stranger(address: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    res = subprocess.run([sys.executable, "-c", STRANGER, address], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _all_refused(tried: dict[str, str]) -> None:
    assert set(tried) == {"plain-tls", "plain-tcp", "own-ca"}
    assert all(v.startswith("refused") for v in tried.values()), tried


def test_the_session_cluster_takes_only_its_own_certificates(dask_cluster):
    from distributed import Client

    assert dask_cluster.startswith("tls://")
    _all_refused(_stranger(dask_cluster))
    with Client(dask_cluster, timeout=30) as c:  # this process: the CA's client certificate
        assert len(workers_info(c)) == 2


def test_the_local_cluster_of_a_plain_run_is_tls_with_the_dashboard_on_loopback():
    cfg = ClusterConfig.model_validate({"workers": [{"name": "w0", "resources": {"rollout": 1, "train": 1}}]})
    assert cfg.security == "auto"  # what `make run` gets: nothing to set, no files to make
    cluster, client = start_cluster(cfg)
    try:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        assert all(a.startswith("tls://127.0.0.1:") for a in workers_info(client))
        assert client.dashboard_link.startswith("http://127.0.0.1:")
        assert client.submit(sum, [1, 2]).result(timeout=60) == 3
        _all_refused(_stranger(cluster.scheduler_address))
    finally:
        client.close()
        cluster.close()
