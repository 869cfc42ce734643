"""The environment team on the in-process ThreadExecutor with the real stages, store and
OpenSpiel's Kuhn poker: the agents' answers are scripted (the SFT warm start's dispatcher,
answering from a table instead of decoding), so every seat's rows can be checked exactly
against the same episodes replayed on a fresh environment: ids, turn indices, masks, rewards,
refused answers and their penalty, one sample per answer or per seat and episode."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.envs import make_environment
from flexmarl_core.envs.play import episode_seed
from flexmarl_core.inference.api import Generation
from flexmarl_core.teams.environment import EnvironmentTeam
from storage import MEGStore
from tests._runs import train_on_threads

pytest.importorskip("pyspiel", reason="open_spiel is a dev dependency (make setup installs it)")

KUHN = str(Path(__file__).resolve().parents[2] / "configs" / "env_kuhn.yaml")
SMALL = ["train.iterations=1", "train.evaluate=false", "train.evaluate_initial=false", "workload.heldout_size=8",
         "batch.inputs_per_iteration=4", "batch.group_size=3", "batch.micro_batch_inputs=2"]


def script(agent: str, traj: int, k: int) -> str:
    """alice (player_0): pass, then bet if she acts again. bob (player_1): traj 0 always bets;
    traj 1 passes; traj 2 says nothing legal once, then bets."""
    if agent == "alice":
        return "[pass]" if k == 0 else "I [bet]"
    if traj == 2 and k == 0:
        return "hmm"
    return "[pass]" if traj == 1 else "[bet]"


class ScriptedDispatcher:
    """A scripted model behind the real `Dispatcher` seam: answers `script(agent, traj, k)` for
    the agent's k-th answer in the trajectory, tokenized with the agent's tokenizer."""

    def __init__(self, team: EnvironmentTeam, seen: list[tuple[str, int]] | None = None) -> None:
        self.team, self.seen = team, seen
        self.calls: dict[tuple[str, int, str], int] = defaultdict(int)

    def capacity(self, agent: str) -> int:
        return 1 << 10

    def decode(self, agent, version, groups, stats):
        out = []
        if self.seen is not None:
            self.seen.extend((agent, version) for _ in groups)
        for g in groups:
            input_id, traj = g.trajectory
            k = self.calls[(input_id, traj, agent)]
            self.calls[(input_id, traj, agent)] += 1
            text = script(agent, traj, k)
            ids = self.team.tokenizer(agent).encode(text, add_special_tokens=False)
            out.append([Generation(list(g.prompt_ids), ids, text, [-0.5] * len(ids), "stop", version)])
        stats.instance = "scripted"
        return out


class ScriptedHost:
    def __init__(self, team: EnvironmentTeam, seen: list[tuple[str, int]] | None = None) -> None:
        self.dispatch = ScriptedDispatcher(team, seen)

    @contextlib.contextmanager
    def detached(self):
        yield

    def dispatcher(self, ctx, worker):
        return self.dispatch


def _run(tmp_path: Path, *overrides: str, seen: list[tuple[str, int]] | None = None):
    """The scripted run of configs/env_kuhn.yaml with `overrides`; `seen` collects the
    (agent, weights version) of every decoded row."""
    cfg = load_config(KUHN, [f"run_dir={tmp_path / 'run'}", *SMALL, *overrides])
    folder, out = train_on_threads(cfg, lambda team: ScriptedHost(team, seen))
    return cfg, folder, out


def _replay(input_id: str, traj: int, penalty: float = -1.0):
    """The episode replayed on a fresh environment with the script: per seat, its answers as
    (k of the agent, text, valid, return), and the seats' outcomes."""
    ep = make_environment("openspiel:kuhn_poker").episode(episode_seed(input_id))
    agents = {"player_0": "alice", "player_1": "bob"}
    calls: dict[str, int] = defaultdict(int)
    answers: list[list] = []
    last: dict[str, list] = {}
    while (turn := ep.turn()) is not None:
        agent = agents[turn.seat]
        k = calls[agent]
        calls[agent] += 1
        text = script(agent, traj, k)
        step = ep.act(text)
        a = [turn.seat, k, text, step.valid, penalty if not step.valid else 0.0]
        answers.append(a)
        last[turn.seat] = a
        for seat, r in step.rewards.items():
            last[seat][4] += r
    ret: dict[str, float] = {}
    for a in reversed(answers):
        a[4] = ret[a[0]] = a[4] + ret.get(a[0], 0.0)
    return answers, ep.returns()


def test_every_seats_rows_match_the_replayed_episodes(tmp_path):
    cfg, folder, out = _run(tmp_path)
    assert audit_run(str(folder))[1] == []
    store = MEGStore(cfg.resolved_store_uri())
    inputs = [r["input_id"] for r in store.read_inputs(0).to_pylist()]
    rows = {a: {r["sample_id"]: r for r in store.read_samples(a, 0).to_pylist()} for a in ("alice", "bob")}
    want_ids: dict[str, set[str]] = {"alice": set(), "bob": set()}
    refused = wins = 0
    for input_id in inputs:
        for traj in range(3):
            answers, returns = _replay(input_id, traj)
            assert sum(returns.values()) == 0  # zero-sum
            wins += returns["player_0"] > 0
            for seat, k, text, valid, ret in answers:
                agent = "alice" if seat == "player_0" else "bob"
                sid = f"{input_id}:{traj}:{agent}:{k}"
                want_ids[agent].add(sid)
                r = rows[agent][sid]
                assert (r["turn"], r["response_text"], r["loss_mask"]) == (k, text, None), sid
                assert json.loads(r["extra"]) == {"seat": seat, "answers": [k], "valid": [valid]}
                assert r["prompt_text"].count("You are " + seat) == 1
                assert r["reward"] == pytest.approx(ret, abs=1e-6), sid
                refused += not valid
    assert {a: set(rows[a]) for a in rows} == want_ids
    assert refused == len(inputs)  # bob's "hmm" once per input, in traj 2
    it0 = out.iterations[0]
    assert it0["team/env/invalid"] == refused and it0["team/env/episodes"] == 3 * len(inputs)
    assert it0["accuracy"] == pytest.approx((wins + sum(  # accuracy: the trained seats' win rate
        _replay(i, t)[1]["player_1"] > 0 for i in inputs for t in range(3))) / (6 * len(inputs)))


def test_multi_turn_samples_join_a_seats_answers_with_the_observations_masked(tmp_path):
    cfg, folder, _ = _run(tmp_path, "team.environment.samples=multi_turn",
                          *(f"team.agents.{a}.chat_template=chatml" for a in ("alice", "bob")))
    assert audit_run(str(folder))[1] == []
    store = MEGStore(cfg.resolved_store_uri())
    alice = store.read_samples("alice", 0).to_pylist()
    twice = [r for r in alice if len(json.loads(r["extra"])["answers"]) == 2]
    assert twice, "bob bets after alice passes in traj 0 and 2: alice answers twice"
    for r in twice:
        mask = r["loss_mask"]
        first, second = "[pass]", "I [bet]"
        assert r["response_text"].startswith(first) and r["response_text"].endswith(second)
        assert 0 in mask and mask[0] == 1 and mask[-1] == 1
        # the masked run is the observation between the answers, as the chat template renders it
        assert "Betting so far" in r["response_text"][len(first):-len(second)]
        input_id, traj = r["input_id"], r["traj"]
        answers, _ = _replay(input_id, traj)
        assert r["reward"] == pytest.approx(answers[0][4])
        assert r["sample_id"] == f"{input_id}:{traj}:alice:0"


def test_rae_subtracts_each_roles_moving_baseline(tmp_path):
    """RAE (`algorithm.advantage: rae`): an answer's advantage is its return less its seat's
    baseline, the moving average of the seat's mean return over earlier iterations."""
    from flexmarl_core.trainers.scopes import ROLE_EMA

    cfg, folder, _ = _run(tmp_path, "train.iterations=2",
                          *(f"team.agents.{a}.algorithm.advantage=rae" for a in ("alice", "bob")))
    assert audit_run(str(folder))[1] == []
    store = MEGStore(cfg.resolved_store_uri())
    for agent in ("alice", "bob"):
        rows = {it: store.read_samples(agent, it).to_pylist() for it in (0, 1)}
        assert all(r["advantage"] == pytest.approx(r["reward"], abs=1e-6) for r in rows[0])
        seats = {json.loads(r["extra"])["seat"] for r in rows[0]}
        for seat in seats:
            mean0 = sum(r["reward"] for r in rows[0] if json.loads(r["extra"])["seat"] == seat) / sum(
                1 for r in rows[0] if json.loads(r["extra"])["seat"] == seat)
            mine = [r for r in rows[1] if json.loads(r["extra"])["seat"] == seat]
            assert mine and all(r["advantage"] == pytest.approx(r["reward"] - (1 - ROLE_EMA) * mean0, abs=1e-5)
                                for r in mine), (agent, seat)


@pytest.mark.parametrize("spec,seats", [
    ("openspiel:tic_tac_toe", {"player_0": "alice", "player_1": "bob"}),
    ("pettingzoo:classic/rps-v2", {"player_0": "alice", "player_1": {"scripted": "random"}}),
])
def test_an_environment_not_among_the_examples_trains_from_a_config_alone(tmp_path, spec, seats):
    """No code: a spec and a seat map in the config, the real stages and real models."""
    import yaml

    pytest.importorskip(spec.split(":")[0].replace("openspiel", "pyspiel"), reason="open_spiel and pettingzoo are dev dependencies (make setup installs them)")
    data = yaml.safe_load(Path(KUHN).read_text())
    data["team"]["environment"] = {"spec": spec, "seats": seats, "options": {"max_cycles": 4} if "rps" in spec else {}}
    data["team"]["agents"] = [a for a in data["team"]["agents"] if a["name"] in {s for s in seats.values() if isinstance(s, str)}]
    config = tmp_path / "env.yaml"
    config.write_text(yaml.safe_dump(data))
    cfg = load_config(config, [f"run_dir={tmp_path / 'run'}", *SMALL])
    folder, out = train_on_threads(cfg)
    assert out.iterations[0]["team/env/episodes"] == 12
    assert audit_run(str(folder))[1] == []
    rows = MEGStore(cfg.resolved_store_uri()).read_samples("alice", 0).to_pylist()
    assert rows and all(r["reward"] is not None and r["consumed_step"] == 0 for r in rows)


def test_a_frozen_seat_decodes_at_its_agents_start_and_trains_nobody(tmp_path):
    """bob plays player_1 frozen: his answers decode at version 0 even in iteration 1 and are
    no samples; alice's are, and train."""
    seen: list[tuple[str, int]] = []
    cfg, folder, out = _run(tmp_path, "train.iterations=2", "team.environment.seats.player_1={agent: bob, frozen: true}",
                            seen=seen)
    assert audit_run(str(folder))[1] == []
    store = MEGStore(cfg.resolved_store_uri())
    assert store.read_samples("bob", 1).num_rows == 0
    alice = store.read_samples("alice", 1).to_pylist()
    assert alice and {r["policy_version"] for r in alice} == {1}
    assert all(m["team/env/episodes"] == 12 for m in out.iterations)
    assert {v for a, v in seen if a == "bob"} == {0} and {v for a, v in seen if a == "alice"} == {0, 1}


def test_a_pool_seat_plays_the_agents_kept_past_versions_drawn_per_episode(tmp_path):
    """Fictitious self-play: alice plays player_0 learning and player_1 as a past self, drawn
    per episode from the versions the run keeps below her current one (0, and every
    keep_every-th); the past selves' answers are no samples."""
    seen: list[tuple[str, int]] = []
    cfg, folder, _ = _run(tmp_path, "train.iterations=3", "train.keep_every=1",
                          "team.agents=[{name: alice, model: {preset: tiny-1m}}]",
                          "team.environment.seats={player_0: alice, player_1: {agent: alice, pool: true}}",
                          "cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}]", seen=seen)
    assert audit_run(str(folder))[1] == []
    store = MEGStore(cfg.resolved_store_uri())
    for it in range(3):
        rows = store.read_samples("alice", it).to_pylist()
        assert rows and {json.loads(r["extra"])["seat"] for r in rows} == {"player_0"}
        assert {r["policy_version"] for r in rows} == {it}
    assert {v for _, v in seen} == {0, 1, 2}
    team = EnvironmentTeam(load_config(KUHN, ["train.keep_every=2",
                                              "team.environment.seats.player_1={agent: bob, pool: true}"]))
    drawn = [team.version("player_1", "bob", 5, f"deal{i}", t) for i in range(50) for t in range(4)]
    assert set(drawn) == {0, 2, 4}  # the kept versions below the current 5, each drawn
    assert drawn == [team.version("player_1", "bob", 5, f"deal{i}", t) for i in range(50) for t in range(4)]
    assert team.version("player_0", "alice", 5, "deal0", 0) == 5
    with pytest.raises(Exception, match="set train.keep_every"):
        EnvironmentTeam(load_config(KUHN, ["team.environment.seats.player_1={agent: bob, pool: true}"]))
