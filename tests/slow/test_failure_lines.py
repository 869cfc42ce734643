"""Every failure an operator meets is one line naming the path, the op (with its agent) and what
to do; bad-config lines name the config file. The real CLI, flow and Dask workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl_core.driver.audit import audit_run
from tests._runs import COMMON, TINY

REPO = Path(__file__).resolve().parents[2]
GSM8K = str(REPO / "configs" / "example_gsm8k.yaml")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env or os.environ.copy(),
                          capture_output=True, text=True, timeout=900)


def _lines(res: subprocess.CompletedProcess) -> list[str]:
    return [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]


@pytest.mark.skipif(os.geteuid() != 0, reason="a small tmpfs to fill needs root to mount (CI runs as root)")
def test_a_full_disk_is_one_line_and_a_resume_after_freeing_space_completes(prefect_api, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(small)], check=True)
    try:
        run_dir = small / "run"
        env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
        sets = [x for o in [f"run_dir={run_dir}", *COMMON, "train.iterations=8"] for x in ("--set", o)]
        res = _cli("train", TINY, *sets, "--no-progress", env=env)
        assert res.returncode == 1, _lines(res)[-20:]
        lines = _lines(res)
        assert len(lines) == 1, lines[-20:]
        line = lines[0]
        assert "No space left on device" in line and str(small) in line and "free space there" in line, line
        assert f"flexmarl train --resume {run_dir}" in line, line
        # Where the disk filled: an op (with its agent) or the file the driver was appending to.
        assert "] it=" in line or f"'{run_dir}/metrics/" in line, line
        subprocess.run(["mount", "-o", "remount,size=512m", str(small)], check=True)
        res = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
        assert res.returncode == 0, _lines(res)[-20:]
        run = audit_run(str(run_dir))
        assert run.problems == [] and run.verdict() == "clean" and run.iterations == list(range(8))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


@pytest.mark.parametrize(("config", "sets", "says"), [
    (TINY, ["store.uri=s3://no-bucket/x?endpoint_override=127.0.0.1:1&scheme=http"], "store.uri"),
    (TINY, ["cluster.address=tls://127.0.0.1:1"], "cluster.address"),
    (GSM8K, ["workload.path=/nonexistent/gsm8k.jsonl"], "/nonexistent/gsm8k.jsonl"),
], ids=["store-unreachable", "scheduler-unreachable", "data-file-missing"])
def test_a_bad_config_line_names_the_config_file(config, sets, says, tmp_path):
    res = _cli("train", config, *[x for s in [f"run_dir={tmp_path / 'run'}", *sets] for x in ("--set", s)],
               "--no-progress")
    assert res.returncode == 2, _lines(res)
    lines = _lines(res)
    assert len(lines) == 1 and lines[0].startswith(f"error: {config}: ") and says in lines[0], lines


def test_a_lost_worker_is_one_line_of_flexmarls_not_dasks_errors(prefect_api, tmp_path):
    from tests._runs import plant_fault

    run_dir = tmp_path / "run"
    plant_fault(run_dir, "kill", "rollout[solver] it=1 mb=0")  # the worker process dies once
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    res = _cli("train", TINY, *[x for o in [f"run_dir={run_dir}", *COMMON] for x in ("--set", o)], env=env)
    assert res.returncode == 0, _lines(res)[-30:]
    lines = _lines(res)
    lost = [x for x in lines if " lost (" in x]
    assert len(lost) == 1 and "run again" in lost[0], lines
    assert not any("distributed." in x or "Traceback" in x or "ERROR" in x for x in lines), lines
    assert audit_run(str(run_dir)).verdict() == "clean"
