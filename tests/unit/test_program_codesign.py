"""Program teams with the rest of the co-design, on the in-process ThreadExecutor with the real
stages: LoRA agents on a shared base, bounded staleness, advantages over trajectories that call
an agent a different number of times, and the SFT warm start recording the program's own
prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.control import ControlPlane, MoveInstance
from flexmarl_core.driver import run
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.ops import Op, StageResult
from flexmarl_core.programs.team import program_team
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
from flexmarl_core.teams import team_shape
from flexmarl_core.trainers.scopes import advantages
from flexmarl_core.workloads import make_workload
from storage import MEGStore

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = ["train.iterations=2", "train.evaluate=false", "train.evaluate_initial=false", "train.warm_start=none",
         "workload.heldout_size=8", "batch.inputs_per_iteration=4", "batch.group_size=2",
         "batch.micro_batch_inputs=2", "workload.reward=tests.reward_fns:varied", "workload.credit=team"]


def _threaded(config: str, overrides: list[str], run_dir: Path):
    cfg = load_config(str(CONFIGS / config), [f"run_dir={run_dir}", *SMALL, *overrides])
    folder = run.prepare_run(cfg, log=lambda _: None)
    ex = ThreadExecutor(stage_fn(str(folder)), {w.name: dict(w.resources) for w in cfg.cluster.workers})
    try:
        return cfg, run.train(cfg, folder, ex)
    finally:
        ex.close()


def test_lora_agents_on_one_base_as_a_program(tmp_path):
    lora = [f"team.agents.{a}.model={{base: tiny-1m, lora: {{rank: 4}}}}" for a in ("planner", "solver", "verifier")]
    cfg, out = _threaded("program_team.yaml", lora, tmp_path / "run")
    assert [m["iteration"] for m in out.iterations] == [0, 1]
    assert audit_run(str(cfg.resolved_run_dir()))[1] == []
    store = MEGStore(cfg.resolved_store_uri())
    assert {r["policy_version"] for r in store.read_samples("solver", 1).to_pylist()} == {1}


def test_bounded_staleness_on_a_program_team(tmp_path):
    stale = ["codesign.max_staleness=1", "train.iterations=3",
             *[f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in ("planner", "solver", "verifier")]]
    cfg, out = _threaded("program_team.yaml", stale, tmp_path / "run")
    assert audit_run(str(cfg.resolved_run_dir()))[1] == []
    store = MEGStore(cfg.resolved_store_uri())
    for it in range(3):  # rollouts of iteration i use a version in [i - 1, i], trained at i
        versions = {r["policy_version"] for r in store.read_samples("solver", it).to_pylist()}
        assert versions and all(it - 1 <= v <= it for v in versions), (it, versions)


def _row(input_id: str, traj: int, turn: int, reward: float) -> dict:
    return {"input_id": input_id, "traj": traj, "turn": turn, "reward": reward}


def test_advantages_when_trajectories_call_an_agent_a_different_number_of_times():
    # One input, three trajectories: traj 0 called the agent twice, 1 and 2 once.
    rows = [_row("a", 0, 0, 1.0), _row("a", 0, 1, 1.0), _row("a", 1, 0, 0.0), _row("a", 2, 0, 0.5)]
    per_call = advantages("grpo", rows)
    # call 0: rewards (1, 0, 0.5), mean 0.5, std 0.5 -> (1, -1, 0); call 1 is a group of one -> 0
    assert per_call == pytest.approx([1.0, 0.0, -1.0, 0.0], abs=1e-5)
    per_traj = advantages("grpo", rows, per_trajectory=True)
    # one reward per trajectory, (1, 0, 0.5) -> (1, -1, 0), every call of traj 0 gets its 1
    assert per_traj == pytest.approx([1.0, 1.0, -1.0, 0.0], abs=1e-5)


def test_program_groups_trajectory_trains_through_the_run(tmp_path):
    cfg, _ = _threaded("program_retry.yaml", ["team.program_groups=trajectory"], tmp_path / "run")
    store = MEGStore(cfg.resolved_store_uri())
    rows = store.read_samples("solver", 0).to_pylist()
    by_traj: dict[tuple[str, int], set[float]] = {}
    for r in rows:
        by_traj.setdefault((r["input_id"], r["traj"]), set()).add(round(r["advantage"], 6))
    assert all(len(v) == 1 for v in by_traj.values())  # every call of a trajectory: one advantage
    # An untrained verifier rarely agrees: trajectories made more than one solver call.
    assert sum(len(json.loads(r["extra"])["calls"]) for r in rows) > len(by_traj)


def test_sft_demonstrations_of_a_program_are_its_own_prompts():
    """The default team as a program records exactly the YAML team's SFT pairs (same prompts,
    same targets); with perturbation, the verifier sometimes sees a solver's mistake."""
    cfg = load_config(str(CONFIGS / "program_team.yaml"), ["workload.heldout_size=8"])
    yaml_cfg = load_config(str(CONFIGS / "default.yaml"), ["workload.heldout_size=8"])
    wl = make_workload(cfg.workload, cfg.team)
    problems = wl.problems("train", 12, seed=3)
    team = program_team(cfg.team, cfg.seed)
    got = team.demonstrations(wl, problems, seed=0, perturb=0.0)
    want = team_shape(yaml_cfg).demonstrations(make_workload(yaml_cfg.workload, yaml_cfg.team), problems,
                                               seed=0, rng=random.Random(0), perturb=0.0)
    tok = team.agents["solver"].tokenizer
    for agent in ("planner", "solver", "verifier"):
        assert sorted((tok.decode(ids), target) for ids, target in got[agent]) == sorted(want[agent]), agent
    shaken = team.demonstrations(wl, problems, seed=0, perturb=1.0)
    answers = {p.input_id: p.answer for p in problems}
    seen = [tok.decode(ids).split("\nA:")[1].split("\n")[0] for ids, _ in shaken["verifier"]]
    assert any(s not in answers.values() for s in seen)  # mistakes shown downstream
    assert all(t in answers.values() for _, t in shaken["verifier"])  # targets stay right


def test_program_ops_move_instances_to_the_agent_whose_calls_take_longest():
    """The control plane of a program team: each program op reports each agent's decode
    seconds; queued program ops weigh every agent by them, so an instance moves from the agent
    whose calls are cheap to the one whose calls are not."""
    cfg = load_config(str(CONFIGS / "program_team.yaml"), [])
    plane = ControlPlane(cfg, [a.name for a in cfg.team.agents], clock=lambda: 0.0)
    res = StageResult(Op(0, "program", mb=0), t_start=0.0, t_end=5.0, metrics={
        "agent/planner/program/decode_s": 4.0, "agent/solver/program/decode_s": 0.5,
        "agent/verifier/program/decode_s": 0.5})
    plane.observed(res)
    assert plane.balancer.est_s == {"planner": 4.0, "solver": 0.5, "verifier": 0.5}
    workers = {"w0": {"rollout:planner": 1, "train": 1}, "w1": {"rollout:solver": 1, "rollout:verifier": 1, "train": 1}}
    retagged: list[tuple[str, dict]] = []
    ready = [Op(1, "program", mb=j) for j in range(4)]
    after = plane.place(ready, [], workers, lambda w, tags: retagged.append((w, tags)))
    assert retagged and retagged[0][0] == "w1" and after["w1"]["rollout:planner"] == 1
    moves = [d for d in plane.decisions if isinstance(d, MoveInstance)]
    assert moves and moves[0].to_agent == "planner"


def test_a_program_op_retried_after_it_committed_reports_the_committed_work(tmp_path):
    """A worker killed after the op's manifests are written but before the driver logged it:
    the retry (on resume) finds the op committed and reports that op's samples, tokens and
    metrics, so the iteration's figures are computed from it (a skipped op with no
    `team/accuracy` once stopped a resumed run)."""
    from flexmarl_core.driver.metrics import iteration_metrics
    from flexmarl_core.ops import OpRecord
    from flexmarl_core.stages.registry import run_stage

    cfg, _ = _threaded("program_team.yaml", [], tmp_path / "run")
    run_dir = str(cfg.resolved_run_dir())
    logged = [json.loads(x) for x in (Path(run_dir) / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    first = next(o for o in logged if o["kind"] == "program" and o["iteration"] == 1)
    committed = StageResult.from_row(first)
    again = run_stage(run_dir, committed.op)
    assert again.skipped
    assert (again.samples, again.tokens, again.version) == (committed.samples, committed.tokens, committed.version)
    assert again.metrics == committed.metrics and "team/accuracy" in again.metrics
    m = iteration_metrics([OpRecord(again.op, again.t_start, again.t_end, again)], [], 1, again.t_start)
    assert m["accuracy"] == committed.metrics["team/accuracy"] and m["tokens"] == committed.tokens
