"""PPO with a critic (`algorithm.advantage: gae`): the estimator pinned by hand on a 3-agent,
2-round team read from a real MEG Store, the clipped value loss, the critic's trainer (state
round trip, per-token values), the plan's critic ops and the config's errors."""

from __future__ import annotations

import pytest
import torch

from flexmarl_core.algorithms import explained_variance, gae_chain, gae_tokens, value_loss
from flexmarl_core.config import ConfigError, config_from_dict
from flexmarl_core.config.critic import critic_names
from flexmarl_core.meg import MEG, sample_id
from flexmarl_core.ops import Op
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.runfiles.location import RunLocation
from flexmarl_core.runtime.worker import WorkerContext
from flexmarl_core.teams import team_shape
from flexmarl_core.trainers.critic import targets
from flexmarl_core.training.critic import CriticTrainer, ValueSample
from storage import MEGStore
from tests._models_util import tiny_model

# Three agents over two rounds: a -> b -> c, and c's answer feeds a in the next round.
ROUNDS_TEAM = {
    "agents": [{"name": "a", "template": "{input} {c}"}, {"name": "b", "template": "{input} {a}"},
               {"name": "c", "template": "{input} {b}"}],
    "edges": ["a -> b", "b -> c", {"src": "c", "dst": "a", "recurrent": True}],
    "rounds": 2, "output": "c",
}
# Calls in order a0 b0 c0 a1 b1 c1; binary fractions so float32 storage is exact.
REWARDS = [0.0, 0.5, 0.0, 0.0, 0.25, 1.0]
VALUES = [0.5, 0.25, 0.75, 0.5, 0.25, 0.5]
# By hand, gamma = lam = 0.5 (gamma * lam = 0.25), V_6 = 0, backwards:
#   d5 = 1    + 0.5*0    - 0.5  =  0.5     A5 = 0.5                          R5 = 1.0
#   d4 = 0.25 + 0.5*0.5  - 0.25 =  0.25    A4 = 0.25  + 0.25*0.5   = 0.375   R4 = 0.625
#   d3 = 0    + 0.5*0.25 - 0.5  = -0.375   A3 = -0.375 + 0.25*0.375 = -0.28125   R3 = 0.21875
#   d2 = 0    + 0.5*0.5  - 0.75 = -0.5     A2 = -0.5 + 0.25*-0.28125 = -0.5703125   R2 = 0.1796875
#      (c of round 0 bootstraps from a of round 1)
#   d1 = 0.5  + 0.5*0.75 - 0.25 =  0.625   A1 = 0.625 + 0.25*-0.5703125 = 0.482421875   R1 = 0.732421875
#   d0 = 0    + 0.5*0.25 - 0.5  = -0.375   A0 = -0.375 + 0.25*0.482421875 = -0.25439453125
#                                                                          R0 = 0.24560546875
HAND_ADV = [-0.25439453125, 0.482421875, -0.5703125, -0.28125, 0.375, 0.5]
HAND_RET = [0.24560546875, 0.732421875, 0.1796875, 0.21875, 0.625, 1.0]


def gae_cfg(team=None, **critic):
    team = team or ROUNDS_TEAM
    agents = [{**a, "algorithm": {"advantage": "gae"}} for a in team["agents"]]
    return config_from_dict({"team": {**team, "agents": agents},
                             "critic": {"gamma": 0.5, "lam": 0.5, **critic},
                             "batch": {"inputs_per_iteration": 1, "group_size": 2, "micro_batch_inputs": 1}})


def test_gae_chain_matches_the_hand_computation():
    adv, ret = gae_chain(REWARDS, VALUES, gamma=0.5, lam=0.5)
    assert adv == HAND_ADV and ret == HAND_RET  # exact: every figure is a binary fraction


def test_gae_targets_follow_the_call_order_across_agents_and_rounds(tmp_path):
    """Rows written to a real store in another order come back chained a0 b0 c0 a1 b1 c1; each
    of the input's two trajectories is its own chain."""
    cfg = gae_cfg()
    meg = MEG.from_config(cfg.team)
    order = meg.call_order()
    assert sorted(order, key=order.get) == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1)]
    store = MEGStore(str(tmp_path / "store"))
    for agent in ("c", "a", "b"):
        rows, status = [], []
        for traj in (1, 0):
            for turn in (1, 0):
                sid = sample_id("p0", traj, agent, turn)
                k = order[(agent, turn)]
                rows.append({"sample_id": sid, "input_id": "p0", "traj": traj, "turn": turn, "mb": 0,
                             "policy_version": 0, "prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-1.0]})
                # trajectory 1 doubles every reward and value: its figures double too
                status.append({"sample_id": sid, "policy_version": 0, "mb": 0,
                               "reward": REWARDS[k] * (1 + traj), "value": VALUES[k] * (1 + traj)})
        store.write_samples(agent, 0, rows)
        store.write_status(agent, 0, status)
    ctx = WorkerContext(loc=RunLocation(tmp_path), cfg=cfg, team=team_shape(cfg), _store=store)
    rows, tg = targets(ctx, 0, 0)
    assert [(r["traj"], r["agent"], r["turn"]) for r in rows] == [
        (t, a, k) for t in (0, 1) for k in (0, 1) for a in "abc"]
    for traj in (0, 1):
        for (agent, turn), k in order.items():
            t = tg[sample_id("p0", traj, agent, turn)]
            scale = 1 + traj
            assert t.advantages == [HAND_ADV[k] * scale], (traj, agent, turn)
            assert t.returns == [HAND_RET[k] * scale] and t.old_values == [VALUES[k] * scale]


def test_gae_per_token_chains_tokens_with_rewards_at_call_ends():
    # call 0: tokens valued 0.5, 0.25; call 1: one token valued 0.5; rewards 0.25 then 1.
    adv, ret = gae_tokens([0.25, 1.0], [[0.5, 0.25], [0.5]], gamma=0.5, lam=0.5)
    # by hand: t2 d=1-0.5=0.5 A=0.5; t1 d=0.25+0.25-0.25=0.25 A=0.25+0.125=0.375;
    #          t0 d=0+0.125-0.5=-0.375 A=-0.375+0.09375=-0.28125
    assert adv == [[-0.28125, 0.375], [0.5]]
    assert ret == [[0.21875, 0.625], [1.0]]


def test_clipped_value_loss_takes_the_larger_of_plain_and_clipped():
    v = torch.tensor([1.0, 0.0, 0.5])
    old = torch.tensor([0.5, 0.5, 0.5])
    ret = torch.tensor([0.0, 1.0, 0.5])
    # row 0: plain (1-0)^2=1, clipped 0.5+0.2=0.7 -> 0.49: max 1. row 1: plain 1, clipped
    # 0.3 -> 0.49: max 1. row 2: both 0. Each times 0.5.
    assert value_loss(v, old, ret, clip=0.2).tolist() == [0.5, 0.5, 0.0]
    # A value that moved toward the target past the clip pays the clipped (larger) error.
    got = value_loss(torch.tensor([0.9]), torch.tensor([0.0]), torch.tensor([1.0]), clip=0.5)
    torch.testing.assert_close(got, torch.tensor([0.5 * 0.5 ** 2]))
    assert value_loss(v, old, ret, clip=None).tolist() == [0.5, 0.5, 0.0]


def test_explained_variance():
    assert explained_variance([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 1.0
    assert explained_variance([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]) == 0.0
    assert explained_variance([0.0], [1.0]) != explained_variance([0.0], [1.0])  # NaN: no variance


def _critic(per_token=False, seed=7):
    return CriticTrainer(tiny_model(), hidden=16, per_token=per_token, lr=1e-2, max_grad_norm=1.0,
                         value_clip=0.2, seed=seed, agents=["a", "b"])


def _batch(per_token=False):
    out = []
    for i, (p, r) in enumerate([(4, 3), (6, 2), (3, 5)]):
        n = r if per_token else 1
        out.append(ValueSample(list(range(5, 5 + p)), list(range(40, 40 + r)), "a" if i else "b",
                               [0.0] * n, [float(i + 1)] * n))
    return out


def test_critic_starts_at_zero_and_learns_toward_its_returns():
    tr = _critic()
    batch = _batch()
    assert tr.values(batch) == [[0.0], [0.0], [0.0]]  # the output layer starts at 0
    for _ in range(3):
        stats = tr.accumulate(batch, loss_scale=1.0 / 3)
        tr.step()
    assert tr.version == 3
    assert set(stats) == {"value_loss", "value_loss/a", "value_loss/b"}
    # the value moved (the head got gradients) and stays a finite number per sample
    vals = tr.values(batch)
    assert all(v[0] != 0.0 and v[0] == v[0] for v in vals)


def test_critic_values_per_token_one_per_response_token():
    tr = _critic(per_token=True)
    batch = _batch(per_token=True)
    tr.accumulate(batch, loss_scale=0.1)
    tr.step()
    vals = tr.values(batch)
    assert [len(v) for v in vals] == [3, 2, 5]
    # the first token's position is the observation's: the per-call value reads the same place
    # (float32: the longer sequence changes the matmul shapes, hence the last bits)
    one = CriticTrainer(tiny_model(), hidden=16, per_token=False, lr=1e-2, max_grad_norm=1.0,
                        value_clip=0.2, seed=7, agents=["a", "b"])
    one.load_state(tr.state())
    torch.testing.assert_close([v[0] for v in one.values(batch)], [v[0] for v in vals], rtol=1e-5, atol=1e-6)


def test_critic_further_epochs_reuse_the_cached_features_and_fit_better():
    """`step(epochs)`: updates per micro-batch after the accumulated one, on the features the
    accumulate cached; the version moves once. A caller's agent the critic does not value is
    an error naming it."""
    batch = _batch()
    one, four = _critic(), _critic()
    for tr, epochs in ((one, []), (four, [[(0, batch)]] * 3)):
        tr.accumulate(batch, 1.0 / 3, key=0)
        tr.step(epochs, 1.0 / 3)
        assert tr.version == 1 and not tr._cache
    err = [sum((v[0] - s.returns[0]) ** 2 for v, s in zip(tr.values(batch), batch, strict=True)) for tr in (one, four)]
    assert err[1] < err[0]
    with pytest.raises(ValueError, match="agent 'z'"):
        one.values([ValueSample([1, 2], [3], "z")])
    # a state loaded in (the critic moved here) drops features kept for the old state's batches
    four.accumulate(batch[:1], 1.0, key=0)
    four.load_state(one.state())
    assert not four._cache


def test_critic_state_round_trip_is_bit_exact():
    """Swapped out after a step with gradients pending, a fresh trainer given the state steps
    exactly as the original does (weights, Adam moments, pending gradients, version)."""
    from flexmarl_core.training.handles import drop, get, put

    a = _critic()
    batch = _batch()
    a.accumulate(batch, 0.3)
    a.step()
    a.accumulate(batch[:2], 0.3)  # pending gradients travel with the state
    b = _critic(seed=99)  # another init: everything must come from the state
    h = put(a.state(), "memory")
    b.load_state(get(h))
    drop(h)  # the process-wide buffer pool gets it back (tests/unit/test_training.py checks the pool)
    for tr in (a, b):
        tr.accumulate(batch[2:], 0.3)
        tr.step()
    assert a.version == b.version == 2
    for k, v in a.weights().items():
        assert torch.equal(v, b.weights()[k]), k


def test_plan_critic_ops_wait_for_their_micro_batch_only():
    cfg = gae_cfg(team={
        "agents": [{"name": "p", "template": "{input}"}, {"name": "s", "template": "{input} {p}"}],
        "edges": ["p -> s"]})
    cfg = cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"inputs_per_iteration": 4,
                                                                       "micro_batch_inputs": 2})})
    plan = Plan.build(cfg)
    assert critic_names(cfg) == {"critic": ["p", "s"]}
    deps = plan.deps
    assert deps[Op(0, "value", "critic", mb=1)] == [Op(0, "reward", mb=1)]
    assert deps[Op(1, "value", "critic", mb=0)] == [Op(1, "reward", mb=0), Op(0, "sync", "critic")]
    assert deps[Op(0, "train", "critic", mb=1)] == [Op(0, "value", "critic", mb=1)]
    assert Op(0, "value", "critic", mb=1) in deps[Op(0, "train", "s", mb=1)]
    assert Op(0, "value", "critic", mb=0) not in deps[Op(0, "train", "s", mb=1)]  # no batch barrier
    assert deps[Op(0, "sync", "critic")] == [Op(0, "step", "critic")]
    per = gae_cfg(shared=False, team={
        "agents": [{"name": "p", "template": "{input}"}, {"name": "s", "template": "{input} {p}"}],
        "edges": ["p -> s"]})
    plan = Plan.build(per)
    # each critic's training needs every critic's values of the micro-batch (one GAE chain)
    assert set(plan.deps[Op(0, "train", "critic-p", mb=0)]) == {
        Op(0, "value", "critic-p", mb=0), Op(0, "value", "critic-s", mb=0)}


@pytest.mark.parametrize("change, message", [
    ({"mixed": True}, "use algorithm.advantage gae but ['b'] do not"),
    ({"name": "critic"}, "are the names of the run's critics"),
    ({"base": "nobody"}, "critic.base 'nobody' is not an agent"),
    ({"program": True}, "needs the call order of a YAML team's graph"),
])
def test_critic_config_errors_name_the_field(change, message):
    agents = [{"name": change.get("name", "a"), "template": "{input}", "algorithm": {"advantage": "gae"}},
              {"name": "b", "template": "{input}",
               "algorithm": {"advantage": "grpo" if change.get("mixed") else "gae"}}]
    team = {"agents": agents, "edges": [f"{agents[0]['name']} -> b"]}
    if change.get("program"):
        team = {"agents": [{k: v for k, v in a.items() if k != "template"} for a in agents],
                "program": "examples/programs/debate_team.py:team"}
    data = {"team": team, "critic": {"base": change["base"]} if "base" in change else {}}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        config_from_dict(data, source="t.yaml")


def test_step_discount_credit_pays_each_call_by_its_place(tmp_path):
    """`credit: step_discount` in a real (threaded) run of the tiny chain: per trajectory the
    planner, solver and verifier get 0.81, 0.9 and 1 x the one team reward (format term off)."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.run import prepare_run, train
    from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
    from tests._runs import TINY

    cfg = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "train.iterations=1", "train.evaluate=false",
                             "workload.reward=tests.reward_fns:varied", "workload.credit=step_discount",
                             "workload.credit_gamma=0.9", "workload.format_weight=0"])
    rd = prepare_run(cfg, log=lambda _: None)
    train(cfg, rd, ThreadExecutor(stage_fn(str(rd)), {w.name: w.resources for w in cfg.cluster.workers}))
    store = MEGStore(cfg.resolved_store_uri())
    got = {a: {(r["input_id"], r["traj"]): r["reward"] for r in store.read_samples(a, 0).to_pylist()}
           for a in ("planner", "solver", "verifier")}
    team = got["verifier"]
    assert len(team) == 8 and len(set(team.values())) > 1
    for key, r in team.items():
        assert got["solver"][key] == pytest.approx(0.9 * r, rel=1e-12)
        assert got["planner"][key] == pytest.approx(0.81 * r, rel=1e-12)


def test_step_discount_needs_a_graph_team():
    team = {"agents": [{"name": "a"}, {"name": "b"}], "program": "examples/programs/debate_team.py:team"}
    with pytest.raises(ConfigError, match="workload.credit step_discount needs the call order"):
        config_from_dict({"team": team, "workload": {"credit": "step_discount"}}, source="t.yaml")


def test_critic_ops_rerun_after_the_step_find_their_work_done(tmp_path):
    """A resumed run may rerun a critic op that finished but was not logged: after the critic
    stepped, its value, train and step ops of that iteration change nothing."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.run import prepare_run, train
    from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
    from flexmarl_core.stages import context, run_stage
    from tests._runs import TINY

    cfg = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "train.iterations=1", "train.evaluate=false",
                             "workload.reward=tests.reward_fns:varied", "workload.credit=team",
                             *[f"team.agents.{a}.algorithm.advantage=gae" for a in ("planner", "solver", "verifier")]])
    rd = prepare_run(cfg, log=lambda _: None)
    train(cfg, rd, ThreadExecutor(stage_fn(str(rd)), {w.name: w.resources for w in cfg.cluster.workers}))
    before = MEGStore(cfg.resolved_store_uri()).read_samples("solver", 0).column("value").to_pylist()
    head = {k: v.clone() for k, v in context(str(rd)).trainers["critic"].weights().items()}
    for op in (Op(0, "value", "critic", mb=1), Op(0, "train", "critic", mb=0), Op(0, "step", "critic")):
        assert run_stage(str(rd), op).skipped, op.name
    assert MEGStore(cfg.resolved_store_uri()).read_samples("solver", 0).column("value").to_pylist() == before
    tr = context(str(rd)).trainers["critic"]
    assert tr.version == 1 and all(torch.equal(v, head[k]) for k, v in tr.weights().items())


def test_per_token_critic_through_a_run(tmp_path):
    """`critic.per_token`: every stored sample carries one value per response token (its first
    the call's value), the agents train on per-token advantages, and the audit is clean."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.audit import audit_run
    from flexmarl_core.driver.run import prepare_run, train
    from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
    from tests._runs import TINY

    cfg = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "train.iterations=2", "train.evaluate=false",
                             "workload.reward=tests.reward_fns:varied", "workload.credit=team", "critic.per_token=true",
                             *[f"team.agents.{a}.algorithm.advantage=gae" for a in ("planner", "solver", "verifier")]])
    rd = prepare_run(cfg, log=lambda _: None)
    out = train(cfg, rd, ThreadExecutor(stage_fn(str(rd)), {w.name: w.resources for w in cfg.cluster.workers}))
    store = MEGStore(cfg.resolved_store_uri())
    for agent in ("planner", "solver", "verifier"):
        for r in store.read_samples(agent, 1).to_pylist():
            assert len(r["token_values"]) == len(r["response_ids"]) and r["value"] == r["token_values"][0]
            assert r["consumed_step"] == 1
    assert all(row["agent/critic/train/grad_norm"] > 0 for row in out.iterations)
    assert audit_run(rd)[1] == []
