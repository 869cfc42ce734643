"""Retention (`driver/retention.py`): a run keeps the initial weights, the versions rollouts
may still read, the newest full checkpoint and every `keep_every`-th, and deletes the rest as
it goes; a crash between a new version's write and an old one's delete loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver.retention import KeepRule
from flexmarl_core.orchestrator.hooks import Callbacks
from flexmarl_core.runfiles.location import RunLocation
from flexmarl_core.stages.faults import faults_dir, held_ops
from tests._runs import (
    COMMON,
    REPO,
    TINY,
    assert_exactly_once,
    assert_same_weights,
    kill_group_when,
    ops_log,
)

AGENTS = ("planner", "solver", "verifier")
OFF_POLICY = [f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in AGENTS]


def rule(*overrides: str) -> KeepRule:
    cfg = load_config(TINY, list(overrides))
    return KeepRule(cfg.codesign.max_staleness, cfg.train.keep_every)


def test_the_rule_keeps_what_rollouts_and_a_resume_read():
    on_policy = rule()
    # k = 0, every step written (a cluster): the newest state, and weights 0 and the newest.
    assert on_policy.states([3, 4, 5], stepped=5) == {5}
    assert on_policy.weights([0, 1, 2, 3, 4, 5], synced=5, states={5}) == {0, 5}
    # A step in flight wrote a state past the durable one: both stay.
    assert on_policy.states([4, 5, 6], stepped=5) == {5, 6}
    # Between checkpoints (one process, checkpoint_every 10): the last checkpoint a replay starts
    # from stays, and so do its weights (the newest full checkpoint).
    assert on_policy.states([10, 20], stepped=27) == {20}
    assert on_policy.weights([0, 10, 20, 27], synced=27, states={20}) == {0, 20, 27}
    # A program or environment team samples with every agent's weights: an agent ahead of
    # the others keeps its versions back to the lowest synced, which a repair may need.
    assert on_policy.weights([0, 3, 4, 5], synced=5, states={5}, floor=4) == {0, 4, 5}
    stale = rule("codesign.max_staleness=2", "train.keep_every=4", *OFF_POLICY)
    assert stale.weights(list(range(11)), synced=10, states={10}) == {0, 4, 8, 9, 10}
    assert stale.states([4, 8, 9, 10], stepped=10) == {4, 8, 10}


def test_an_uninterrupted_run_kept_the_final_checkpoint_and_the_initial_weights(baseline):
    """The session's tiny run (k = 0, two workers: every step written): version 1 is gone."""
    loc = RunLocation(baseline.resolved_run_dir())
    for agent in AGENTS:
        assert loc.versions(f"weights/{agent}") == [0, 2], agent
        assert loc.versions(f"trainers/{agent}") == [2], agent


def test_staleness_and_partial_rollouts_read_only_kept_versions(tmp_path):
    """k = 1 with partial rollouts over five iterations on the tiny team's two workers (in
    threads: every step written), `keep_every: 2`: after every op no agent holds more than
    k + 1 odd weight versions and two odd trainer states, the run completes (no rollout found
    its version deleted) exactly once, what is left is exactly the rule's, and each iteration's
    partitions were compacted by the run."""
    from flexmarl_core.driver import run
    from flexmarl_core.sim.threads import ThreadExecutor, stage_fn

    cfg = load_config(TINY, [f"run_dir={tmp_path}/run", *COMMON, "train.iterations=5", "train.keep_every=2",
                             "codesign.max_staleness=1", "codesign.partial_rollouts=true", *OFF_POLICY])
    folder = run.prepare_run(cfg, log=lambda _: None)
    loc = RunLocation(folder)
    most: dict[str, tuple[int, int]] = {}

    def count(_record) -> None:
        for a in AGENTS:
            w = [v for v in loc.versions(f"weights/{a}") if v % 2]
            s = [v for v in loc.versions(f"trainers/{a}") if v % 2]
            m = most.get(a, (0, 0))
            most[a] = (max(m[0], len(w)), max(m[1], len(s)))

    ex = ThreadExecutor(stage_fn(str(folder)), {w.name: dict(w.resources) for w in cfg.cluster.workers})
    try:
        outcome = run.train(cfg, folder, ex, hooks=[Callbacks(op_done=count)])
    finally:
        ex.close()
    assert len(outcome.iterations) == 5
    assert_exactly_once(cfg)
    # The run compacted each final iteration's partitions: one sample fragment each, no status
    # fragment left (every status row folded into its sample), read exactly once above.
    assert outcome.compacted[0] == 5 * len(AGENTS)
    store = Path(cfg.resolved_store_uri())
    for a in AGENTS:
        for it in range(5):
            assert len(list((store / "samples" / f"agent={a}" / f"iteration={it}").glob("*.parquet"))) == 1
            assert not list((store / "status" / f"agent={a}" / f"iteration={it}").glob("*.parquet"))
    for a in AGENTS:
        assert most[a][0] <= 2 and most[a][1] <= 2, (a, most[a])
        assert loc.versions(f"weights/{a}") == [0, 2, 4, 5], a
        assert loc.versions(f"trainers/{a}") == [2, 4, 5], a


def test_a_crash_between_a_new_versions_write_and_the_deletes_then_resume(baseline, prefect_api, tmp_path):
    """kill -9 of the training process while the planner's sync of iteration 1 has published
    version 2 (held there, before the flow recorded it): version 1 is still on disk, every file
    whole; `--resume` reruns that sync, completes with the undisturbed run's weights, exactly
    once, and leaves what an undisturbed run leaves."""
    run_dir = tmp_path / "run"
    held = "sync[planner] it=1 published"
    folder = Path(faults_dir(run_dir))
    folder.mkdir(parents=True)
    (folder / f"hold@{held}").write_text("600")  # until the kill
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    sets = [x for o in [f"run_dir={run_dir}", *COMMON] for x in ("--set", o)]

    def cli(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    kill_group_when(cli("train", TINY, *sets, "--no-progress"), lambda: held in held_ops(run_dir))
    loc = RunLocation(run_dir)
    assert loc.versions("weights/planner") == [0, 1, 2]
    assert "sync[planner] it=1" not in [o["op"] for o in ops_log(run_dir)]
    for marker in folder.iterdir():
        marker.unlink()
    resumed = cli("train", "--resume", str(run_dir), "--no-progress")
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    cfg = load_config(run_dir / "config.yaml")
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    for agent in AGENTS:
        assert loc.versions(f"weights/{agent}") == [0, 2], agent
        assert loc.versions(f"trainers/{agent}") == [2], agent


@pytest.mark.parametrize("every", [None, 1])
def test_keep_every_one_keeps_every_version(every):
    keep = rule(*([] if every is None else [f"train.keep_every={every}"]))
    kept = keep.weights(list(range(6)), synced=5, states={5})
    assert kept == ({0, 5} if every is None else set(range(6)))


def test_a_resume_drops_what_the_earlier_attempt_recorded_but_had_not_deleted(tmp_path):
    """The earlier attempt recorded the solver's last sync (version 2) and died before deleting
    version 1; the resume runs no op of the solver. Once it ends, version 1 goes all the same."""
    from flexmarl_core.driver.retention import Retention
    from flexmarl_core.ops import Op, OpRecord, StageResult
    from flexmarl_core.runfiles.location import trainer_key, weights_key

    loc = RunLocation(tmp_path)
    for v in (0, 1, 2):
        loc.write_bytes(weights_key("solver", v), b"w")
    loc.write_bytes(trainer_key("solver", 2), b"t")
    earlier = [OpRecord(op, 0.0, 1.0, StageResult(op)) for op in (Op(1, "step", "solver"), Op(1, "sync", "solver"))]
    kept = Retention(rule(), loc, durable=lambda: 0)
    kept.restore(earlier)
    kept.release()  # the resume is under way: nothing of the earlier attempt is dropped yet
    assert loc.versions("weights/solver") == [0, 1, 2]
    kept.release(everything=True)
    assert loc.versions("weights/solver") == [0, 2] and loc.versions("trainers/solver") == [2]
