"""The inter-agent load balancer's decisions, as pure functions of queued work and instances."""

from __future__ import annotations

import math
import time

import pytest

from flexmarl_core.control import InstanceBalancer, apply_move

AGENTS = ["planner", "solver", "verifier"]


def test_load_is_seconds_of_queued_work_per_instance():
    b = InstanceBalancer(AGENTS)
    b.observe("planner", 4.0)
    b.observe("solver", 1.0)
    loads = b.monitor({"planner": 2, "solver": 2, "verifier": 1},
                      {"planner": ["w0"], "solver": ["w0", "w1"], "verifier": []})
    assert loads["planner"] == 8.0  # 2 x 4 s on one instance
    assert loads["solver"] == 1.0  # 2 x 1 s over two instances
    assert loads["verifier"] == math.inf  # work and no instance at all
    b.observe("planner", 2.0)  # moving average
    assert b.est_s["planner"] == 3.0


def test_moves_an_instance_from_the_coldest_agent_to_the_hottest():
    b = InstanceBalancer(AGENTS, threshold=2.0, weight_bytes={"planner": 123})
    b.observe("planner", 2.0)
    inst = {"planner": ["w0"], "solver": ["w1"], "verifier": ["w0"]}
    move = b.step({"planner": 3}, inst, {"w0": 1.0, "w1": 0.0})
    assert move is not None
    assert (move.worker, move.to_agent, move.from_agent) == ("w1", "planner", "solver")
    assert move.cost_bytes == 123 and move.monitor_us >= 0 and move.decide_us >= 0
    apply_move(inst, move)
    assert inst == {"planner": ["w0", "w1"], "solver": [], "verifier": ["w0"]}
    # Two instances for 3 queued tasks on a 2-worker cluster: nowhere left to move to.
    assert b.step({"planner": 3}, inst, {"w0": 1.0, "w1": 0.0}) is None


def test_no_move_below_threshold_or_when_every_task_has_an_instance():
    b = InstanceBalancer(AGENTS, threshold=2.0)
    inst = {"planner": ["w0"], "solver": ["w1"], "verifier": ["w1"]}
    # planner 2 queued vs solver 2 queued, same speed: ratio 1 < 2.
    assert b.step({"planner": 2, "solver": 2}, inst, {"w0": 2.0, "w1": 2.0}) is None
    # One queued task and one instance: another instance would not help.
    assert b.step({"planner": 1}, inst, {"w0": 1.0, "w1": 0.0}) is None


def test_keeps_last_instance_of_an_agent_with_work_and_tags_in_use():
    b = InstanceBalancer(AGENTS, threshold=2.0)
    b.observe("planner", 10.0)
    b.observe("solver", 0.1)
    inst = {"planner": ["w0"], "solver": ["w1"], "verifier": ["w0"]}
    # solver still has a task queued: w1 is shared, not taken from it.
    move = b.step({"planner": 4, "solver": 1}, inst, {"w0": 4.0, "w1": 1.0})
    assert move is not None and (move.worker, move.from_agent) == ("w1", None)
    # No queued work, but a task of verifier is pinned to w2: its tag stays.
    inst = {"planner": ["w0"], "solver": ["w1"], "verifier": ["w2", "w1"]}
    move = b.step({"planner": 4}, inst, {"w0": 4.0, "w1": 3.0, "w2": 0.0}, in_use={("w2", "verifier")})
    assert move is not None and (move.worker, move.from_agent) == ("w2", None)


def test_agent_without_instance_is_served_first():
    b = InstanceBalancer(AGENTS)
    inst = {"planner": ["w0", "w1"], "solver": [], "verifier": ["w1"]}
    move = b.step({"solver": 1, "planner": 1}, inst, {"w0": 1.0, "w1": 0.0})
    assert move is not None and move.to_agent == "solver"
    assert move.worker == "w1" and move.from_agent == "verifier"


def test_a_move_to_a_worker_holding_the_same_lora_base_costs_only_the_adapter():
    # planner and solver are adapters on base "b"; the verifier is a full model.
    b = InstanceBalancer(AGENTS, threshold=2.0, weight_bytes={"planner": 10, "solver": 10, "verifier": 500},
                         base_of={"planner": "b", "solver": "b"}, base_bytes={"b": 1000})
    b.observe("planner", 2.0)
    inst = {"planner": ["w0"], "solver": ["w1"], "verifier": ["w2"]}
    assert b.move_cost("w1", "planner", inst) == 10  # w1 serves the solver: the base is there
    assert b.move_cost("w2", "planner", inst) == 1010
    assert b.move_cost("w2", "verifier", inst) == 500  # full models: their weights, as before
    # Equal load on w1 and w2: the move goes where the base already is, and says what it cost.
    move = b.step({"planner": 3, "verifier": 0, "solver": 0}, inst, {"w0": 0.0, "w1": 0.0, "w2": 0.0})
    assert move is not None and (move.worker, move.to_agent) == ("w1", "planner") and move.cost_bytes == 10
    # With w1 busier, the less loaded worker still wins (load first) and pays for the base.
    move = b.step({"planner": 3, "verifier": 0, "solver": 0}, inst, {"w0": 0.0, "w1": 5.0, "w2": 0.0})
    assert move is not None and move.worker == "w2" and move.cost_bytes == 1010


def test_an_instance_moved_in_is_not_taken_away_before_it_served():
    """Hysteresis: a worker moved to an agent keeps it until a rollout of that agent was routed
    there (the weights were loaded for it), even when the agent it came from turns hot again."""
    b = InstanceBalancer(AGENTS, threshold=2.0)
    b.observe("planner", 1.0)
    b.observe("solver", 1.0)
    inst = {"planner": ["w0", "w1"], "solver": ["w2"], "verifier": []}
    move = b.step({"solver": 4}, inst, {"w0": 0.0, "w1": 0.0, "w2": 4.0})
    assert move is not None and (move.to_agent, move.from_agent) == ("solver", "planner")
    apply_move(inst, move)
    b.fresh.add((move.worker, "solver"))
    # The planner is now the hot one, the solver idle: w-moved stays with the solver.
    back = b.step({"planner": 6}, inst, {"w0": 0.0, "w1": 0.0, "w2": 0.0})
    assert back is None or back.worker != move.worker, back
    b.fresh.discard((move.worker, "solver"))  # a solver rollout was routed there
    back = b.step({"planner": 6}, inst, {"w0": 0.0, "w1": 0.0, "w2": 0.0})
    assert back is not None and back.from_agent == "solver"


def test_a_placement_wave_is_linear_in_workers_not_agents_times_workers(monkeypatch):
    """`rebalance` reads each worker's tags once: 100 agents on 400 workers, where a tag lookup
    per (agent, worker) pair was 40,000 a wave (13 ms at 100 agents on 192 instances); counted
    through the tag names it builds."""
    from flexmarl_core.control import balancer as bal
    from flexmarl_core.ops import Op

    built = []
    monkeypatch.setattr(bal, "rollout_tag", lambda a: built.append(a) or f"rollout:{a}")
    agents = [f"a{i}" for i in range(100)]
    workers = {f"w{j}": {f"rollout:a{j % 100}": 1.0} for j in range(400)}
    b = InstanceBalancer(agents)
    ready = [Op(0, "rollout", "a0", 0, j) for j in range(8)]
    out, moves = bal.rebalance(b, ready, [], workers, {}, lambda w, t: None, 0.0)
    assert moves and len(built) <= 2 * len(moves), len(built)
    assert sum(1 for r in out.values() if r.get("rollout:a0")) == 4 + len(moves)


# -- warm estimates -------------------------------------------------------------------------

WARM_TEAM = {
    "agents": [
        {"name": "planner", "template": "{input}", "sampling": {"max_new_tokens": 8}},
        {"name": "solver", "template": "Q:{input}\nP:{planner}\nS:", "sampling": {"max_new_tokens": 32}},
    ],
    "edges": ["planner -> solver"],
}


def _warm_cfg(iterations: int = 1):
    from flexmarl_core.config import config_from_dict

    return config_from_dict({"team": WARM_TEAM, "train": {"iterations": iterations},
                             "batch": {"inputs_per_iteration": 2, "micro_batch_inputs": 2}})


def test_op_sizes_come_from_prompts_and_response_lengths():
    from flexmarl_core.control import token_sizes
    from flexmarl_core.control.ledger import PREFILL_WEIGHT
    from flexmarl_core.meg import MEG

    cfg = _warm_cfg()
    sizes = token_sizes(MEG.from_config(cfg.team))
    solver_prompt = len("Q:{input}\nP:{planner}\nS:") + 8  # its template and the planner's answer
    assert sizes["rollout"] == {"planner": 8 + PREFILL_WEIGHT * len("{input}"),
                                "solver": 32 + PREFILL_WEIGHT * solver_prompt}
    assert sizes["train"] == {"planner": 8 + len("{input}"), "solver": 32 + solver_prompt}


def test_an_unmeasured_agent_is_estimated_at_its_size():
    from flexmarl_core.control import WorkLedger
    from flexmarl_core.ops import Op, traits

    led = WorkLedger(sizes={"rollout": {"planner": 10.0, "solver": 30.0, "verifier": 20.0}})
    # Before any rollout: the default, scaled by size around the mean size.
    assert led.estimate("rollout", "planner") == traits("rollout").guess_s * 10 / 20
    assert led.estimate("rollout", "solver") == traits("rollout").guess_s * 30 / 20
    led.observe(Op(0, "rollout", "planner"), 2.0)
    assert led.estimate("rollout", "planner") == 2.0
    assert led.estimate("rollout", "solver") == 6.0  # the planner's seconds per unit, x 30
    led.observe(Op(0, "rollout", "solver"), 4.0)
    assert led.estimate("rollout", "solver") == 4.0  # measured: its own history
    # The verifier at the measured agents' mean seconds per unit (0.2 and 4/30), x 20; it
    # follows each new observation.
    assert led.estimate("rollout", "verifier") == pytest.approx(20 * (0.2 + 4 / 30) / 2)
    led.observe(Op(1, "rollout", "planner"), 4.0)  # planner: 3.0 s, 0.3 per unit
    assert led.estimate("rollout", "verifier") == pytest.approx(20 * (0.3 + 4 / 30) / 2)
    # A kind without sizes keeps the mean of the measured agents.
    led.observe(Op(0, "train", "planner"), 1.0)
    assert led.estimate("train", "solver") == 1.0


def test_the_balancer_reads_the_warm_estimate_of_an_unmeasured_agent():
    from flexmarl_core.control import ControlPlane
    from flexmarl_core.ops import Op

    cp = ControlPlane(_warm_cfg(), ["planner", "solver"], clock=lambda: 0.0,
                      sizes={"rollout": {"planner": 1.0, "solver": 4.0}})
    cp.ledger.observe(Op(0, "rollout", "planner"), 3.0)
    loads = cp.balancer.monitor({"planner": 1, "solver": 1}, {"planner": ["w0"], "solver": ["w1"]})
    assert loads == {"planner": 3.0, "solver": 12.0}


def test_a_resumed_run_starts_from_its_earlier_attempts_measurements(tmp_path):
    """The earlier attempt's op log (written by a real `run.train`) warms a new control plane:
    its estimates are the measured durations' moving averages, not the defaults."""
    from flexmarl_core.control import ControlPlane
    from flexmarl_core.driver.run import completed_records, train
    from flexmarl_core.ops import StageResult
    from flexmarl_core.sim.threads import ThreadExecutor

    secs = {"planner": 0.02, "solver": 0.06}

    def fn(op, worker):
        t0 = time.time()
        time.sleep(secs.get(op.agent, 0.0) if op.kind == "rollout" else 0.0)
        metrics = {"team/accuracy": 0.0} if op.kind == "reward" else {}
        return StageResult(op, worker=worker, t_start=t0, t_end=time.time(), metrics=metrics)

    cfg = _warm_cfg(iterations=2)
    ex = ThreadExecutor(fn, {"w0": {"rollout": 1, "train": 1}})
    try:
        train(cfg, tmp_path, ex)
    finally:
        ex.close()
    earlier = completed_records(tmp_path)
    cp = ControlPlane(cfg, ["planner", "solver"], clock=time.time)
    cold = cp.ledger.estimate("rollout", "solver")
    cp.warm(r.result for r in earlier)
    rolls = sorted((r.result for r in earlier if r.op.kind == "rollout" and r.op.agent == "solver"),
                   key=lambda r: r.t_end)
    expect = rolls[0].seconds
    for r in rolls[1:]:
        expect = 0.5 * expect + 0.5 * r.seconds
    assert cp.ledger.estimate("rollout", "solver") == pytest.approx(expect, rel=1e-9)
    assert cp.ledger.estimate("rollout", "solver") >= secs["solver"] != cold
