"""Secret references in config values (`${env:NAME}`, `${secret:BLOCK}`) resolve only where a
value is used, and an unresolvable one names the field and the reference; a run folder flexmarl
creates is its owner's only. The end-to-end check that no secret is written anywhere is
tests/slow/test_secrets_canary.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from flexmarl_core.config import ClusterConfig, ConfigError, load_config
from flexmarl_core.config import secrets as sec
from flexmarl_core.runfiles.location import PRIVATE_MODE, make_private

REPO = Path(__file__).resolve().parents[2]


def test_env_references_resolve_and_literals_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXMARL_T_PW", "s3cr3t")
    assert sec.resolve("${env:FLEXMARL_T_PW}", "f") == "s3cr3t"
    assert sec.resolve("https://me:${env:FLEXMARL_T_PW}@host/x", "f") == "https://me:s3cr3t@host/x"
    for literal in ("plain", "", "$HOME", "${HOME}", "a ${b} c"):  # no `${kind:name}`: as written
        assert sec.resolve(literal, "f") == literal
    assert sec.references("x ${env:A} ${secret:b-1}") == ["${env:A}", "${secret:b-1}"]
    assert sec.resolve_map({"K": "${env:FLEXMARL_T_PW}", "L": "v"}, "cluster.worker_env") == {"K": "s3cr3t", "L": "v"}


def test_unresolvable_references_name_field_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXMARL_T_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"^cluster\.worker_env\.AWS_SECRET_ACCESS_KEY: "
                       r"\$\{env:FLEXMARL_T_UNSET\} is not set$"):
        sec.resolve_map({"AWS_SECRET_ACCESS_KEY": "${env:FLEXMARL_T_UNSET}"}, "cluster.worker_env")
    with pytest.raises(sec.SecretError, match=r"^f: \$\{vault:x\}: unknown reference kind 'vault'"):
        sec.resolve("${vault:x}", "f")
    with pytest.raises(sec.SecretError, match=r"^f: \$\{env: \} names nothing"):
        sec.resolve("${env: }", "f")


def test_a_resolver_says_why_and_never_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    def vault(name: str) -> str:
        if name != "ok":
            raise sec.Unresolved("is not in the vault")
        return "the-value"

    monkeypatch.setitem(sec._RESOLVERS, "vault", vault)
    assert sec.resolve("${vault:ok}", "f") == "the-value"
    with pytest.raises(sec.SecretError) as exc:
        sec.resolve("${vault:ok}${vault:nope}", "f")
    assert str(exc.value) == "f: ${vault:nope} is not in the vault"
    assert exc.value.__cause__ is None and exc.value.__suppress_context__  # no traceback to leak through


def test_a_kind_this_process_has_not_registered_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sec._RESOLVERS, "secret", raising=False)
    with pytest.raises(sec.SecretError, match=r"f: \$\{secret:blk\}: this process cannot resolve 'secret'"):
        sec.resolve("${secret:blk}", "f")


def test_config_keeps_the_reference_text() -> None:
    """Loading and dumping a config never resolves: the run folder's copy keeps the reference."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["cluster.worker_env={K: '${env:FLEXMARL_T_UNSET}'}"])
    assert cfg.cluster.worker_env == {"K": "${env:FLEXMARL_T_UNSET}"}
    assert "${env:FLEXMARL_T_UNSET}" in str(cfg.model_dump())


def test_start_cluster_refuses_an_unset_reference_before_any_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow's own cluster start (a deployment skips the CLI's check) names the field."""
    from flexmarl_core.cluster import start_cluster

    monkeypatch.delenv("FLEXMARL_T_UNSET", raising=False)
    cfg = ClusterConfig.model_validate({"worker_env": {"TOKEN": "${env:FLEXMARL_T_UNSET}"}})
    with pytest.raises(ConfigError, match=r"cluster\.worker_env\.TOKEN: \$\{env:FLEXMARL_T_UNSET\} is not set"):
        start_cluster(cfg, dashboard=False)


def test_secret_resolver_registers_without_talking_to_prefect() -> None:
    """`tasks.secrets.install` only registers; the API is asked when a value is used."""
    from tasks.secrets import install

    install()
    assert "secret" in sec._RESOLVERS


def test_make_private_creates_0700_and_keeps_an_existing_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        make_private(tmp_path / "a" / "run")
        assert stat.S_IMODE((tmp_path / "a" / "run").stat().st_mode) == PRIVATE_MODE == 0o700
        assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755  # parents: the usual mode
        (tmp_path / "mine").mkdir(mode=0o750)
        make_private(tmp_path / "mine")
        assert stat.S_IMODE((tmp_path / "mine").stat().st_mode) == 0o750
        make_private(f"file://{tmp_path}/b")
        assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o700
        make_private("s3://bucket/runs/x")  # an object store: nothing to make here
    finally:
        os.umask(old)


def test_the_lease_makes_a_private_run_folder(tmp_path: Path) -> None:
    """The lease (taken before anything else is written) makes a new run folder 0700."""
    from flexmarl_core.driver.lease import RunLease
    from flexmarl_core.runfiles.location import RunLocation

    lease = RunLease.acquire(RunLocation(tmp_path / "leased"), resume=False, overwrite=False)
    lease.release()
    assert stat.S_IMODE((tmp_path / "leased").stat().st_mode) == 0o700
