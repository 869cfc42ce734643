"""TLS on every Dask connection flexmarl makes or starts.

A Dask scheduler runs whatever a connected client sends it, so a plain `tcp://` cluster lets
anyone who reaches its port run code as the user: on a shared machine, any other account. With
TLS, every connection (client, scheduler, nanny, worker) presents a certificate signed by the
cluster's CA and checks the other side's (Dask's contexts are `CERT_REQUIRED` both ways; they
do not check host names, which a cluster addressed by IP could not pass).

- A local cluster (`cluster.security: auto`) gets a CA and one certificate made for the run,
  in memory only: nothing to make by hand, nothing left on disk.
- `flexmarl cluster certs DIR` makes the files a real cluster needs: the CA and a certificate
  and key per role (scheduler, worker, client).
- At a `tls://` address the flow's client uses `cluster.security`'s files, or Dask's own
  settings (`distributed.comm.tls.*`, as `dask scheduler`/`dask worker` read them).

EC P-256 keys: generated in milliseconds (RSA 2048: ~0.1-1 s) and any TLS 1.2+ peer takes them.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from distributed.security import Security

from flexmarl_core.config import ClusterConfig, ConfigError
from flexmarl_core.config.cluster import TLSFilesConfig
from flexmarl_core.config.secrets import references, resolve

ROLES = ("scheduler", "worker", "client")
#: a certificate made by `flexmarl cluster certs` lasts this long; a run's own, this long too
DAYS = 365


@dataclass(frozen=True)
class Pem:
    cert: str
    key: str


def _name(cn: str):  # noqa: ANN202 - an x509.Name; cryptography is imported lazily
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key) -> str:  # noqa: ANN001 - an EC private key
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def make_pems(roles: tuple[str, ...] = ROLES, days: int = DAYS) -> tuple[str, dict[str, Pem]]:
    """A new CA (its certificate's PEM; its key is dropped: nothing more can be signed) and a
    certificate + key signed by it for each role."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("flexmarl-cluster-ca")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {}
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(f"flexmarl-{role}")).issuer_name(ca_name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid[0]).not_valid_after(valid[1])
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))
        out[role] = Pem(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))
    return ca.public_bytes(serialization.Encoding.PEM).decode(), out


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def make_certs(folder: Path, days: int = DAYS) -> list[Path]:
    """Write `ca.pem` and `<role>.pem` + `<role>-key.pem` (0600) for each role into `folder`
    (made 0700 if new). Refuses to overwrite: a half-replaced set would lock the cluster out."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    names = ["ca.pem"] + [f"{r}{s}.pem" for r in ROLES for s in ("", "-key")]
    there = [n for n in names if (folder / n).exists()]
    if there:
        raise ConfigError(f"{folder}: {there} already exist; remove them or choose an empty folder")
    ca, pems = make_pems(days=days)
    _write(folder / "ca.pem", ca, 0o644)
    for role, pem in pems.items():
        _write(folder / f"{role}.pem", pem.cert, 0o644)
        _write(folder / f"{role}-key.pem", pem.key, 0o600)
    return [folder / n for n in names]


def temporary() -> Security:
    """A CA and one certificate for every role, made now and kept in memory (the local cluster's)."""
    ca, pems = make_pems(("run",))
    pem = pems["run"]
    return Security(require_encryption=True, tls_ca_file=ca,
                    **{f"tls_{r}_{k}": v for r in ROLES for k, v in (("cert", pem.cert), ("key", pem.key))})


def _pem_or_path(value: str, field: str) -> str:
    """A file path as it is (Dask reads it); a `${...}` reference resolved to the PEM it holds."""
    if references(value):
        return resolve(value, field)
    if not Path(value).expanduser().is_file():
        raise ConfigError(f"{field}: {value!r} is not a file")
    return str(Path(value).expanduser())


def _files(tls: TLSFilesConfig, roles: tuple[str, ...]) -> Security:
    ca = _pem_or_path(tls.ca_file, "cluster.security.ca_file")
    cert = _pem_or_path(tls.cert_file, "cluster.security.cert_file")
    key = _pem_or_path(tls.key_file, "cluster.security.key_file") if tls.key_file else None
    kw: dict[str, str | None] = {}
    for r in roles:
        kw[f"tls_{r}_cert"], kw[f"tls_{r}_key"] = cert, key
    return Security(require_encryption=True, tls_ca_file=ca, **kw)


def cluster_security(cfg: ClusterConfig) -> Security | None:
    """The Security of this process's connections: for a local cluster, every role's; at
    `cfg.address`, the client's. None: plain tcp (`security: none`)."""
    if cfg.security == "none":
        return None
    if cfg.address is None:
        return temporary() if cfg.security == "auto" else _files(cfg.security, ROLES)
    if isinstance(cfg.security, TLSFilesConfig):
        return _files(cfg.security, ("client",))
    sec = Security()  # Dask's own settings: distributed.comm.tls.* (dask.yaml, DASK_* env)
    if not (sec.tls_ca_file and sec.tls_client_cert):
        raise ConfigError(
            f"cluster.address {cfg.address!r} is tls:// but this process has no client certificate: "
            "set cluster.security: {ca_file, cert_file, key_file} (see `flexmarl cluster certs`) or "
            "Dask's distributed.comm.tls.ca-file / client.cert / client.key"
        )
    return sec
