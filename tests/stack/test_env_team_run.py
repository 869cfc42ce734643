"""Environment teams on the real stack (Prefect flow, Dask workers, the store): each protocol
(OpenSpiel, TextArena, PettingZoo AEC, a user's class) trains from its example config; on Kuhn
poker every seat's rows replay on a fresh environment to the rewards stored; a worker killed
under an episode op, and the whole run killed with kill -9 and resumed, leave the same rows as
an undisturbed run, committed once."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.envs import make_environment
from flexmarl_core.envs.play import episode_seed
from flexmarl_core.programs.manifest import committed_ids
from storage import MEGStore
from tests._runs import kill_group_when, ops_log, plant_fault
from tests.stack.test_faults import _cli

pytest.importorskip("pyspiel", reason="open_spiel is a dev dependency (make setup installs it)")

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 2
SMALL = [f"train.iterations={ITERATIONS}", "train.warm_start=none", "train.evaluate=false",
         "train.evaluate_initial=false", "batch.inputs_per_iteration=4", "batch.group_size=2",
         "batch.micro_batch_inputs=2", "workload.heldout_size=8", "cluster.prefect_lean=true"]


def _flow(config: str, overrides: list[str]):
    from flows.train import train

    return train(str(REPO / "configs" / config), overrides, progress=False, return_state=True)


def _rows(run_dir: Path) -> dict[tuple[str, int], list[dict]]:
    """(agent, iteration) -> its stored rows, by sample id."""
    cfg = load_config(run_dir / "config.yaml")
    store = MEGStore(cfg.resolved_store_uri())
    return {(a, it): sorted(store.read_samples(a, it).to_pylist(), key=lambda r: r["sample_id"])
            for a in cfg.team.environment.agents() if cfg.agent(a).trainable for it in range(ITERATIONS)}


def assert_committed_once(run_dir: Path) -> None:
    cfg = load_config(run_dir / "config.yaml")
    loc = cfg.run_location()
    for (agent, it), rows in _rows(run_dir).items():
        ids = committed_ids(loc, it, range(cfg.batch.num_micro_batches), agent)
        assert sorted(r["sample_id"] for r in rows) == sorted(ids), (agent, it)
        assert all(r["consumed_step"] == it and r["reward"] is not None for r in rows), (agent, it)
        seats = {s for s, c in cfg.team.environment.seats.items() if c.agent == agent}
        for r in rows:
            extra = json.loads(r["extra"])
            assert extra["seat"] in seats and r["turn"] == extra["answers"][0] == int(r["sample_id"].rsplit(":", 1)[1])
    assert audit_run(str(run_dir))[1] == []


@pytest.fixture(scope="module")
def kuhn_run(dask_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kuhn") / "run"
    state = _flow("env_kuhn.yaml", [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *SMALL])
    assert state.is_completed(), state.message
    return run_dir


def _replayed(cfg, rows: list[dict]) -> dict[str, float]:
    """Every episode of one iteration's rows replayed on a fresh environment of `cfg` with the
    stored answers: sample id -> the return its answer earned (the forfeit rule of
    `envs/play.py`). Seats a script plays are answered by that script, seeded as the run's."""
    import random

    from flexmarl_core.envs import scripted_policy

    ecfg = cfg.team.environment
    answers: dict[tuple[str, int, str], list[str]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["turn"]):
        answers[(r["input_id"], r["traj"], r["agent"])].append(r["response_text"])
    out: dict[str, float] = {}
    for input_id, traj in {(i, t) for i, t, _ in answers}:
        seed = episode_seed(input_id)
        ep = make_environment(ecfg.spec, ecfg.options).episode(seed)
        done: list[list] = []
        k: dict[str, int] = defaultdict(int)
        refused: dict[str, int] = defaultdict(int)
        last: dict[str, list] = {}
        scripts = {s: (scripted_policy(c.scripted), random.Random(f"{seed}:{traj}:{s}"))
                   for s, c in ecfg.seats.items() if c.scripted}
        while (turn := ep.turn()) is not None and len(done) < ecfg.max_turns:
            agent = ecfg.seats[turn.seat].agent
            if agent is None:
                policy, rng = scripts[turn.seat]
                text, sid = policy(turn, rng), None
            else:
                text = answers[(input_id, traj, agent)][k[agent]]
                sid = f"{input_id}:{traj}:{agent}:{k[agent]}"
                k[agent] += 1
            step = ep.act(text)
            a = [sid, turn.seat, 0.0 if step.valid else ecfg.invalid_penalty]
            done.append(a)
            last[turn.seat] = a
            refused[turn.seat] = 0 if step.valid else refused[turn.seat] + 1
            for seat, r in step.rewards.items():
                if seat in last:
                    last[seat][2] += r
            if refused[turn.seat] >= ecfg.max_invalid:
                break
        ret: dict[str, float] = {}
        for sid, seat, r in reversed(done):
            ret[seat] = r + ecfg.gamma * ret.get(seat, 0.0)
            if sid is not None:
                out[sid] = ret[seat]
    return out


def _assert_rows_replay(run_dir: Path) -> None:
    cfg = load_config(run_dir / "config.yaml")
    rows = _rows(run_dir)
    for it in range(ITERATIONS):
        mine = [{**r, "agent": a} for (a, i), rs in rows.items() if i == it for r in rs]
        assert {r["sample_id"]: pytest.approx(r["reward"], abs=1e-6) for r in mine} == _replayed(cfg, mine)


def test_kuhn_poker_on_the_real_stack_every_seats_rows_replay_to_their_rewards(kuhn_run):
    assert_committed_once(kuhn_run)
    _assert_rows_replay(kuhn_run)
    eps = [o for o in ops_log(kuhn_run) if o["kind"] == "episode"]
    assert sorted(o["op"] for o in eps) == sorted(f"episode it={i} mb={j}" for i in range(ITERATIONS) for j in range(2))
    assert all(o["busy"] for o in eps) and {b[0] for o in eps for b in o["busy"]} <= {"w0", "w1"}


def test_a_worker_killed_under_an_episode_op_reruns_it_with_the_same_rows(dask_cluster, kuhn_run, tmp_path):
    run_dir = tmp_path / "run"
    marker = plant_fault(run_dir, "kill", "episode it=1 mb=0")
    state = _flow("env_kuhn.yaml", [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *SMALL])
    assert state.is_completed(), state.message
    assert not marker.exists(), "the fault never fired"
    assert_committed_once(run_dir)
    assert sum(o["op"] == "episode it=1 mb=0" for o in ops_log(run_dir)) == 1
    keep = ("sample_id", "response_ids", "reward", "policy_version", "loss_mask")
    assert {k: [{f: r[f] for f in keep} for r in v] for k, v in _rows(run_dir).items()} == \
        {k: [{f: r[f] for f in keep} for r in v] for k, v in _rows(kuhn_run).items()}


def test_kill_9_mid_run_then_resume_leaves_the_same_rows(prefect_api, kuhn_run, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    sets = [x for o in [f"run_dir={run_dir}", *SMALL] for x in ("--set", o)]
    kill_group_when(_cli("train", str(REPO / "configs" / "env_kuhn.yaml"), *sets, "--no-progress", env=env),
                    lambda: (run_dir / "metrics" / "ops.jsonl").exists()
                    and any(r["iteration"] == 1 and r["kind"] == "episode" for r in ops_log(run_dir)))
    resumed = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    assert_committed_once(run_dir)
    names = [o["op"] for o in ops_log(run_dir)]
    assert all(names.count(n) == 1 for n in names if n.startswith("episode")), names
    keep = ("sample_id", "response_ids", "reward", "policy_version")
    assert {k: [{f: r[f] for f in keep} for r in v] for k, v in _rows(run_dir).items()} == \
        {k: [{f: r[f] for f in keep} for r in v] for k, v in _rows(kuhn_run).items()}


@pytest.mark.parametrize("config", ["env_textarena.yaml", "env_pettingzoo.yaml", "env_guess.yaml"])
def test_each_protocol_trains_from_its_example_config(dask_cluster, tmp_path, config):
    package = {"env_textarena.yaml": "textarena", "env_pettingzoo.yaml": "pettingzoo"}.get(config)
    if package is not None:
        pytest.importorskip(package, reason=f"{package} is a dev dependency (make setup installs it)")
    run_dir = tmp_path / "run"
    state = _flow(config, [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *SMALL])
    assert state.is_completed(), state.message
    assert_committed_once(run_dir)
    its = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in its] == list(range(ITERATIONS))
    assert all(m["team/env/episodes"] == 8 for m in its)
    _assert_rows_replay(run_dir)  # every seat's rows, replayed on a fresh environment
