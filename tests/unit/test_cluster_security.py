"""TLS settings of the Dask cluster (flexmarl_core/cluster/security.py): what the config
refuses, the certificates `flexmarl cluster certs` writes, and that they secure a connection."""

from __future__ import annotations

import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl_core.cluster.security import cluster_security, make_certs, temporary
from flexmarl_core.config import ClusterConfig, ConfigError

REPO = Path(__file__).resolve().parents[2]
FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))


def _refused(data: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ClusterConfig.model_validate(data)


def test_a_plain_tcp_address_is_refused_unless_the_config_accepts_it():
    _refused({"address": "tcp://10.0.0.5:8786"}, r"plain tcp: anyone who reaches that scheduler runs code as you")
    _refused({"address": "10.0.0.5:8786"}, "plain tcp")  # Dask's default scheme
    assert ClusterConfig.model_validate({"address": "tcp://10.0.0.5:8786", "security": "none"}).security == "none"
    files = {"ca_file": "ca.pem", "cert_file": "client.pem", "key_file": "client-key.pem"}
    _refused({"address": "tcp://10.0.0.5:8786", "security": files}, "is not tls://")
    assert ClusterConfig.model_validate({"address": "tls://10.0.0.5:8786", "security": files}).security.ca_file == "ca.pem"
    _refused({"security": "maybe"}, "security")


def test_a_tls_address_without_a_client_certificate_names_the_settings(monkeypatch):
    for var in [v for v in __import__("os").environ if v.startswith("DASK_DISTRIBUTED__COMM__TLS")]:
        monkeypatch.delenv(var)
    import dask

    with dask.config.set({"distributed.comm.tls.ca-file": None, "distributed.comm.tls.client.cert": None}):
        with pytest.raises(ConfigError, match=r"cluster.security: \{ca_file, cert_file, key_file\}"):
            cluster_security(ClusterConfig(address="tls://10.0.0.5:8786"))
    cfg = ClusterConfig.model_validate({"address": "tls://10.0.0.5:8786", "security": {
        "ca_file": "/nonexistent/ca.pem", "cert_file": "/nonexistent/c.pem"}})
    with pytest.raises(ConfigError, match=r"cluster.security.ca_file: '/nonexistent/ca.pem' is not a file"):
        cluster_security(cfg)
    assert cluster_security(ClusterConfig(address="tcp://10.0.0.5:8786", security="none")) is None


def test_certs_are_signed_by_their_ca_keys_are_private_and_nothing_is_overwritten(tmp_path):
    folder = tmp_path / "certs"
    res = subprocess.run([FLEXMARL, "cluster", "certs", str(folder)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for role in ("scheduler", "worker", "client"):
        assert stat.S_IMODE((folder / f"{role}-key.pem").stat().st_mode) == 0o600
        # each role's pair loads, and a context trusting only the CA accepts the chain
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(folder / "ca.pem"))
        ctx.load_cert_chain(folder / f"{role}.pem", folder / f"{role}-key.pem")
    assert not (folder / "ca-key.pem").exists()  # the CA's key is never kept
    before = (folder / "ca.pem").read_bytes()
    again = subprocess.run([FLEXMARL, "cluster", "certs", str(folder)],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    assert again.returncode == 2 and "already exist" in again.stderr and "Traceback" not in again.stderr
    assert (folder / "ca.pem").read_bytes() == before


def test_a_runs_own_certificates_are_new_each_time_and_required_both_ways():
    a, b = temporary(), temporary()
    assert a.require_encryption and a.tls_ca_file != b.tls_ca_file
    assert a.tls_scheduler_cert == a.tls_worker_cert == a.tls_client_cert
    ctx = a.get_connection_args("client")["ssl_context"]
    assert ctx.verify_mode == ssl.CERT_REQUIRED


def test_certificates_held_by_reference_are_resolved_to_their_pem_text(tmp_path, monkeypatch):
    make_certs(tmp_path / "c")
    for name in ("ca", "client", "client-key"):
        monkeypatch.setenv(f"T_{name.replace('-', '_').upper()}", (tmp_path / "c" / f"{name}.pem").read_text())
    cfg = ClusterConfig.model_validate({"address": "tls://10.0.0.5:8786", "security": {
        "ca_file": "${env:T_CA}", "cert_file": "${env:T_CLIENT}", "key_file": "${env:T_CLIENT_KEY}"}})
    sec = cluster_security(cfg)
    assert sec.tls_ca_file.startswith("-----BEGIN CERTIFICATE-----") and "PRIVATE KEY" in sec.tls_client_key
    assert sec.get_connection_args("client")["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    monkeypatch.delenv("T_CA")
    with pytest.raises(ConfigError, match=r"cluster.security.ca_file: \$\{env:T_CA\} is not set"):
        cluster_security(cfg)
