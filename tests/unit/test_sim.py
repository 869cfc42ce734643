"""The cluster simulator: calibration against recorded real runs, the real control-plane
policies on a virtual clock, determinism, scale and speed, the CLI.

The recorded runs in tests/data/sim are `flexmarl train configs/default.yaml` on this 2-worker
bench (4 iterations each): the co-design, the synchronous baseline, the serial schedule, the
co-design with late binding at k = 1 (`late-k1`) and each switch off alone.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from flexmarl.cli import main
from flexmarl_core.config import load_config
from flexmarl_core.control import MoveInstance, TrainSlot
from flexmarl_core.meg import MEG
from flexmarl_core.sim.cluster import load_cluster
from flexmarl_core.sim.cost import AgentCost, LengthDist, _queued_decode_s, continuous_decode_s
from flexmarl_core.sim.study import (
    CODESIGN,
    CODESIGN_K1,
    CODESIGN_LATE,
    SERIAL,
    SYNC,
    THOUSAND_DEVICES,
    many_agents,
    replay,
    run_cluster,
    run_modes,
    tables,
)

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "data" / "sim"
SIM = REPO / "configs" / "sim"
MATH = SIM / "math-3x14b.yaml"
PAPER = SIM / "paper-48x16.yaml"
#: a small slice of the paper cluster: 4 inference nodes, 2 one-node training slots
SMALL = ["nodes=6", "inference.nodes=4", "training.nodes=2", "training.group_devices=16"]
ABLATION = ["off-dependency_parallel", "off-load_balancing", "off-async_pipeline", "off-on_demand_allocation"]


@pytest.mark.parametrize("mode", ["codesign", "sync", "serial", "late-k1"])
def test_calibrated_replay_is_within_10_percent_of_the_measured_run(mode):
    out, sim = replay(RECORDED / mode)
    assert abs(out["e2e_error"]) < 0.10, out["e2e_error"]
    assert out["simulated"]["label"] == "simulated"
    assert out["cost_model"]["sources"]["train.train_token_s"].startswith("measured")
    # The balancer moved instances in the recorded co-design and serial runs, not in sync.
    assert (out["simulated"]["balance_moves"] > 0) == (mode != "sync")


def test_calibrated_replays_order_the_ablation_rows_as_measured():
    """Each row replayed with the costs fitted from its own log: every pair of rows the
    measurement tells apart by more than the calibration tolerance (10%) comes out in the
    same order (closer rows are a tie within what the model is held to)."""
    rows = {}
    for run in ["codesign", "sync", "serial", "late-k1", *ABLATION]:
        out, _ = replay(RECORDED / run)
        rows[run] = (out["measured"]["e2e_s_per_iteration"], out["simulated"]["e2e_s_per_iteration"])
    compared = 0
    for (a, (ma, sa)), (b, (mb, sb)) in itertools.combinations(rows.items(), 2):
        if max(ma, mb) / min(ma, mb) > 1.10:
            compared += 1
            assert (ma < mb) == (sa < sb), (a, rows[a], b, rows[b])
    assert compared >= 5


def test_replay_with_switches_is_a_what_if_on_measured_costs():
    out, _ = replay(RECORDED / "codesign", ["codesign.load_balancing=false"])
    assert "measured" not in out and out["simulated"]["balance_moves"] == 0


def _small(cfg_overrides=(), sim=SMALL):
    cluster = load_cluster(PAPER, list(sim))
    return run_cluster(load_config(MATH, ["train.iterations=2", *cfg_overrides]), cluster)


def test_the_real_policies_run_on_the_virtual_clock():
    """Skewed lengths (the solver writes ~3x the planner): the balancer moves instances, the
    allocator takes a slot per agent and iteration; with both off, neither decides anything."""
    on = _small()
    moves = [d for d in on.decisions if isinstance(d, MoveInstance)]
    assert moves and on.summary["balance_moves"] == len(moves)
    assert {m.to_agent for m in moves} & {"solver", "verifier"}
    assert sum(isinstance(d, TrainSlot) for d in on.decisions) == 2 * 3  # agents x iterations
    # Hysteresis: no instance goes back before it ran a rollout of the agent it was moved to.
    assert on.summary["moves_undone"]["moves"] == len(moves) and on.summary["moves_undone"]["unused"] == 0
    off = _small(["codesign.load_balancing=false", "codesign.on_demand_allocation=false"])
    assert not off.decisions
    # One op at a time per worker (a 1-thread Dask worker).
    for res in (on, off):
        by_worker: dict[str, list[tuple[float, float]]] = {}
        for r in res.records:
            by_worker.setdefault(r.result.worker, []).append((r.result.t_start, r.result.t_end))
        for spans in by_worker.values():
            spans.sort()
            assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False))


def test_same_seed_same_run_and_another_seed_another():
    a, b = _small(), _small()
    assert a.summary["e2e_s_per_iteration"] == b.summary["e2e_s_per_iteration"]
    assert [(r.op, r.result.worker, r.result.t_end) for r in a.records] == \
           [(r.op, r.result.worker, r.result.t_end) for r in b.records]
    c = _small(["seed=1"])
    assert c.summary["e2e_s_per_iteration"] != a.summary["e2e_s_per_iteration"]


def test_paper_scale_tables_and_speed():
    results, cluster = run_modes(MATH, PAPER)
    assert cluster.devices == 48 * 16
    t = tables(results)
    assert t["label"] == "simulated" and t["table2"]["speedup"] > 1.0
    assert set(t["table3"]) == {f"{s} off" for s in
                                ("dependency_parallel", "load_balancing", "async_pipeline", "on_demand_allocation")}
    cod = results[CODESIGN].summary
    assert cod["sim_cpu_s_per_iteration"] < 10.0
    assert results[SYNC].summary["utilization_per_pool"]["inference"] < cod["utilization_per_pool"]["inference"]


def test_serial_and_stale_schedules_at_scale():
    """Table 2's other rows: `serial` gives the whole cluster to one agent at a time (the balancer
    moves instances to it; no two agents roll out or train at once), and the co-design at k = 1
    lets rollouts run an iteration ahead of training (the dependency chain stops binding)."""
    results, _ = run_modes(MATH, PAPER, ["train.iterations=3"], ablation=False, schedules=True)
    t = tables(results)["table2"]
    assert {SYNC, SERIAL, CODESIGN, CODESIGN_LATE, CODESIGN_K1} <= set(t)
    ser = results[SERIAL]
    assert ser.summary["balance_moves"] > 0  # every instance goes to the agent rolling out
    for kind in ("rollout", "train"):
        spans: dict[tuple[int, str], tuple[float, float]] = {}
        for r in ser.records:
            if r.op.kind == kind:
                lo, hi = spans.get((r.op.iteration, r.op.agent), (r.result.t_start, r.result.t_end))
                spans[(r.op.iteration, r.op.agent)] = (min(lo, r.result.t_start), max(hi, r.result.t_end))
        order = sorted(spans.values())
        assert all(a[1] <= b[0] for a, b in zip(order, order[1:], strict=False)), kind
    k1 = results[CODESIGN_K1]
    assert k1.summary["dag_bound_s_per_iteration"] < results[CODESIGN].summary["dag_bound_s_per_iteration"]
    sync_end = {r.op.agent: r.result.t_end for r in k1.records if r.op.kind == "sync" and r.op.iteration == 0}
    ahead = [r for r in k1.records if r.op.kind == "rollout" and r.op.iteration == 1
             and r.result.t_start < sync_end[r.op.agent]]
    assert ahead, "no rollout of iteration 1 started before its agent's sync of iteration 0 ended"
    k0 = results[CODESIGN]
    sync_end0 = {r.op.agent: r.result.t_end for r in k0.records if r.op.kind == "sync" and r.op.iteration == 0}
    assert not [r for r in k0.records if r.op.kind == "rollout" and r.op.iteration == 1
                and r.result.t_start < sync_end0[r.op.agent]]
    assert t["speedup_vs_serial"] > 0 and t["speedup_best"] >= t["speedup_on_policy"] >= t["speedup"]
    # Late binding holds a rollout until an instance is idle: none waits pinned behind a tail.
    assert results[CODESIGN_LATE].summary["e2e_s_steady"] < results[CODESIGN].summary["e2e_s_steady"]


def test_replicas_are_released_one_by_one():
    """`inference.release: replica`: an instance's engine replicas take the next rollout as
    their own shares end. Under late binding at k = 1 an instance then holds a second rollout
    while the first's last replicas decode (never a third), and the rollout pool's work packs
    tighter than when each op holds all replicas to its slowest one. Rollouts, not rewards, are
    the ones that overlap; every other op still has its worker to itself."""
    from flexmarl_core.sim.study import modes

    k1 = modes(False, ["planner", "solver", "verifier"])[CODESIGN_K1]
    held = _small([*k1, "train.iterations=4"])
    released = _small([*k1, "train.iterations=4"], sim=[*SMALL, "inference.release=replica"])
    for res, most in ((held, 1), (released, 2)):
        spans: dict[str, list[tuple[float, float, str]]] = {}
        for r in res.records:
            spans.setdefault(r.result.worker, []).append((r.result.t_start, r.result.t_end, r.op.kind))
        overlaps = 0
        for ops in spans.values():
            for t, _, _ in ops:
                live = [o for o in ops if o[0] <= t < o[1]]
                assert len(live) <= most, live
                if len(live) > 1:
                    assert {o[2] for o in live} == {"rollout"}, live
                    overlaps += 1
        assert (overlaps > 0) == (most == 2)
    assert released.summary["e2e_s_steady"] < held.summary["e2e_s_steady"]
    # Same work: every op ran once in both.
    assert sorted(r.op.name for r in held.records) == sorted(r.op.name for r in released.records)


def test_hundred_agents_on_1024_devices_with_decisions_in_microseconds():
    cfg = many_agents(SIM / "models")
    cluster = load_cluster(PAPER, THOUSAND_DEVICES)
    assert cluster.devices == 1024
    res = run_cluster(cfg, cluster)
    s = res.summary
    assert s["ops"] == len(MEG.from_config(cfg.team).agent_names) * 2 * (4 + 4 + 2) + 2 * 4
    assert s["balance_moves"] > 0 and s["train_swaps"] > 0
    assert s["control_route"]["p50_us"] < 1000 and s["balancer_decide"]["p50_us"] < 1000
    assert s["sim_cpu_s"] < 60


def test_vectorised_continuous_batching_matches_the_event_loop():
    rng = np.random.default_rng(3)
    a = AgentCost(prompt_tokens=100, lengths=LengthDist(500, 1.0, 4096), weight_bytes=1, state_bytes=1,
                  step_mem_s=0.01, step_seq_s=0.0004, kv_token_s=1e-7, step_over_s=0.001, max_concurrency=64)
    lengths = a.lengths.sample(rng, 40)
    prompts = rng.integers(50, 400, 40)
    free = continuous_decode_s(prompts, lengths, a)
    assert free == pytest.approx(_queued_decode_s(prompts, lengths, a))
    # Equal lengths, 8 places for 40 sequences: five memory-bound waves instead of one.
    even, a.kv_token_s, a.step_seq_s = np.full(40, 100), 0.0, 0.0
    one = continuous_decode_s(prompts, even, a)
    a.max_concurrency = 8
    assert continuous_decode_s(prompts, even, a) == pytest.approx(5 * one)
    assert lengths.max() <= 4096 and lengths.min() >= 1


def test_cli_prints_tables_writes_json_and_timeline(tmp_path, capsys):
    out_json, png = tmp_path / "sim.json", tmp_path / "tl.png"
    rc = main(["simulate", str(MATH), "--cluster", str(PAPER), *sum((["--set", f"sim.{o}"] for o in SMALL), []),
               "--set", "train.iterations=1", "--json", str(out_json), "--timeline", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Table 2" in text and "Table 3" in text and text.count("(simulated)") >= 3
    data = json.loads(out_json.read_text())
    assert data["label"] == "simulated" and "speedup" in data["table2"] and data["sources"]
    assert png.stat().st_size > 1000 and (tmp_path / "tl-sync.png").exists()


@pytest.mark.parametrize("argv, needle", [
    (["simulate", str(MATH)], "--cluster"),
    (["simulate", "--calibrate", "/nonexistent/run"], "not a finished flexmarl run folder"),
    (["simulate", str(MATH), "--cluster", str(PAPER), "--set", "sim.inference.nodes=60"], "exceeds nodes"),
    (["simulate", str(MATH), "--cluster", str(PAPER), "--set", "team.agents.planner.model.path=null"],
     "team.agents[planner].model.path"),
    (["simulate", str(MATH), "--cluster", str(PAPER), "--sweep", "nonsense"], "--sweep"),
])
def test_cli_user_errors_are_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err


def test_model_descriptions_give_the_published_sizes():
    from flexmarl_core.sim.cluster import ModelSpec

    m14 = ModelSpec.from_folder(SIM / "models" / "qwen2.5-14b", "14b")
    m32 = ModelSpec.from_folder(SIM / "models" / "qwen2.5-32b", "32b")
    assert 14.6e9 < m14.params < 14.9e9 and 32.4e9 < m32.params < 32.9e9  # Qwen2.5: 14.7B, 32.5B
    assert m14.kv_bytes_per_token == 2 * 48 * 8 * 128 * 2 and m32.head_dim == 128
