"""bench/chaos.py's operator phase: what an operator does by mistake, or what the world does
slowly, each through the real CLI on the tiny team, each checked to leave a clean run.

- double launch: a second `flexmarl train` on a live run folder (and `--overwrite`);
- hanging reward: a reward that never returns on one input (`per_kind_s.reward`: 2 s);
- full disk: the run folder on a 24 MB tmpfs, resumed after it grows (needs root to mount;
  reported as not run otherwise);
- damaged store: a truncated fragment before a resume, repaired by `flexmarl store repair`;
- dead API: the run's Prefect API server killed in iteration 2 of 6 and never brought back
  (a server of the scenario's own): the run finishes, says so in one line, and its process
  exits; `dead_api_exit_s` is the time from the kill to the exit (the promise: about a minute
  after the run's last op, under 90 s here).

Each entry of the result says whether it was survived: the run (or its resume) completed, the
mistake was refused or reported in one line, and `store audit` calls the run clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
COMMON = ["train.iterations=2", "train.evaluate=false", "workload.reward=tests.reward_fns:varied",
          "workload.credit=team", "cluster.prefect_lean=true"]


def _cli(env: dict[str, str], *args: str, wait: bool = True) -> Any:
    cmd = [sys.executable, "-m", "flexmarl.cli", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


def _sets(run_dir: Path, *extra: str) -> list[str]:
    return [x for o in [f"run_dir={run_dir}", *COMMON, *extra] for x in ("--set", o)]


def _clean(env: dict[str, str], run_dir: Path) -> bool:
    res = _cli(env, "store", "audit", str(run_dir))
    return res.returncode == 0 and ": clean" in res.stdout


def double_launch(env: dict[str, str], root: Path) -> dict[str, Any]:
    from flexmarl_core.stages.faults import faults_dir, held_ops, release

    run_dir, held = root / "double", "step[planner] it=0"
    Path(faults_dir(run_dir)).mkdir(parents=True)
    (Path(faults_dir(run_dir)) / f"hold@{held}").write_text("")
    first = _cli(env, "train", TINY, *_sets(run_dir), "--no-progress", wait=False)
    deadline = time.time() + 600
    while held not in held_ops(run_dir) and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    seconds = [_cli(env, "train", TINY, *_sets(run_dir), "--no-progress", *extra) for extra in ([], ["--overwrite"])]
    release(run_dir, held)
    first.communicate(timeout=1200)
    refused = all(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "in use" in r.stderr
                  for r in seconds)
    return {"survived": first.returncode == 0 and refused and _clean(env, run_dir),
            "second_launch_said": seconds[0].stderr.strip()}


def hanging_reward(env: dict[str, str], root: Path) -> dict[str, Any]:
    run_dir = root / "hang"
    res = _cli(env, "train", TINY, *_sets(run_dir, "workload.reward=tests.reward_fns:hangs_on_one",
                                           "cluster.deadlines.per_kind_s.reward=2"), "--no-progress")
    rows = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()] \
        if res.returncode == 0 else []
    failed = sum(r.get("failed_trajectories", 0) for r in rows)
    return {"survived": res.returncode == 0 and failed > 0 and _clean(env, run_dir), "failed_trajectories": failed}


def full_disk(env: dict[str, str], root: Path) -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"survived": None, "not_run": "mounting a small tmpfs needs root"}
    small = root / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(small)], check=True)
    try:
        run_dir = small / "run"
        res = _cli(env, "train", TINY, *_sets(run_dir, "train.iterations=8"), "--no-progress")
        said = [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]
        one_line = res.returncode == 1 and len(said) == 1 and "No space left" in said[0] and "--resume" in said[0]
        subprocess.run(["mount", "-o", "remount,size=512m", str(small)], check=True)
        resumed = _cli(env, "train", "--resume", str(run_dir), "--no-progress")
        return {"survived": one_line and resumed.returncode == 0 and _clean(env, run_dir),
                "said": said[0] if said else ""}
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def damaged_store(env: dict[str, str], root: Path) -> dict[str, Any]:
    run_dir = root / "damaged"
    first = _cli(env, "train", TINY, *_sets(run_dir), "--no-progress")
    # Iteration 0 sampled with the initial weights, which every run keeps (a later iteration's
    # weights may be gone: the repair then refuses, naming train.keep_every). The run compacted
    # the partition into one fragment.
    (frag,) = (run_dir / "store" / "samples" / "agent=solver" / "iteration=0").glob("*.parquet")
    frag.write_bytes(frag.read_bytes()[: frag.stat().st_size // 2])
    refused = _cli(env, "train", "--resume", str(run_dir), "--no-progress")
    repaired = _cli(env, "store", "repair", str(run_dir))
    resumed = _cli(env, "train", "--resume", str(run_dir), "--no-progress")
    ok = (first.returncode == 0 and refused.returncode == 2 and "flexmarl store repair" in refused.stderr
          and repaired.returncode == 0 and resumed.returncode == 0 and _clean(env, run_dir))
    return {"survived": ok, "resume_said": refused.stderr.strip()}


#: the dead-API scenario's promise: from the kill to the process's exit (seconds)
DEAD_API_EXIT_S = 90.0


def dead_api(env: dict[str, str], root: Path) -> dict[str, Any]:
    import signal
    import socket

    from flexmarl.prefect_api import start_server, stop_server
    from flexmarl_core.stages.faults import faults_dir, held_ops, release

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    home, run_dir, held = root / "dead-api-prefect", root / "dead-api", "rollout[solver] it=2 mb=1"
    api = start_server(home, port)
    env = {k: v for k, v in env.items() if k not in ("PREFECT_CLIENT_MAX_RETRIES", "FLEXMARL_API_GIVE_UP_S")}
    env.update(PREFECT_API_URL=api, PREFECT_HOME=str(home))
    Path(faults_dir(run_dir)).mkdir(parents=True)
    (Path(faults_dir(run_dir)) / f"hold@{held}").write_text("")
    run = _cli(env, "train", TINY, *_sets(run_dir, "train.iterations=6"), "--no-progress", wait=False)
    try:
        deadline = time.time() + 600
        while held not in held_ops(run_dir) and run.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        stop_server(home, signal.SIGKILL)
        killed = time.time()
        release(run_dir, held)
        out, err = run.communicate(timeout=1200)
        exit_s = time.time() - killed
    finally:
        if run.poll() is None:
            run.kill()
        stop_server(home, signal.SIGKILL)
    said = [x for x in (out + err).splitlines() if "Prefect API" in x]
    ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    last_op_s = max(o["finished"] for o in ops) - killed
    return {"survived": run.returncode == 0 and len(said) == 1 and exit_s < DEAD_API_EXIT_S and _clean(env, run_dir),
            "dead_api_exit_s": round(exit_s, 1), "last_op_after_kill_s": round(last_op_s, 1),
            "exit_after_last_op_s": round(exit_s - last_op_s, 1), "said": said[0] if said else ""}


def operator_phase(api: str) -> dict[str, dict[str, Any]]:
    """Every scenario above against the Prefect API `api` (the dead-API one against a server of
    its own); each one's result."""
    env = {**os.environ, "PREFECT_API_URL": api, "PYTHONPATH": str(REPO)}
    root = Path(tempfile.mkdtemp(prefix="flexmarl-chaos-operator-"))
    return {name: fn(env, root) for name, fn in (
        ("double launch", double_launch), ("hanging reward", hanging_reward),
        ("full disk", full_disk), ("damaged store", damaged_store), ("dead api", dead_api))}
