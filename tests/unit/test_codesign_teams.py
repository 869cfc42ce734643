"""Co-design equals sync, team by team: each team's config runs twice through the real stages
(models, store, rewards, tools, sandbox) on the in-process `ThreadExecutor` with the config's
two workers and their tags, once with every co-design switch off (the synchronous baseline) and
once with all of them on, and the two runs hold the same samples and train the same weights.
The same check on the real Prefect flow and Dask cluster is `tests/stack/test_run_e2e.py`; this one
covers every team at a fraction of its cost. Team-specific checks of what the run stored (the
tool team's inserted calculator output, the code team's sandboxed rewards) ride on the runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flexmarl_core.config import ExperimentConfig, load_config
from flexmarl_core.driver import run
from flexmarl_core.meg import MEG
from flexmarl_core.runtime.worker import save_state_atomic, weights_path
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
from flexmarl_core.workloads import Problem, make_workload
from storage import MEGStore
from tests._models_util import calling_floor, calling_model, tiny_model, tokenizer
from tests.unit.test_tool_team import _runs, call_before

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SWITCHES = ["dependency_parallel", "load_balancing", "async_pipeline", "on_demand_allocation",
            "late_binding", "gradient_helpers"]
ITERATIONS = 2
#: two micro-batches of two inputs, groups of two: every schedule difference shows, cheaply
SMALL = [f"train.iterations={ITERATIONS}", "train.evaluate=false", "train.evaluate_initial=false",
         "train.warm_start=none", "workload.heldout_size=8", "batch.inputs_per_iteration=4",
         "batch.group_size=2", "batch.micro_batch_inputs=2"]
#: a reward that varies for untrained models, so every agent gets a gradient
VARIED = ["workload.reward=tests.reward_fns:varied", "workload.credit=team"]
TEAMS: dict[str, tuple[str, list[str]]] = {
    "arith": ("tiny.yaml", VARIED),
    "tool": ("tool_team.yaml", VARIED),  # its init_from (a solver that calls the tool) is added below
    "code": ("code_team.yaml", []),
    "longtail": ("longtail_team.yaml", [*VARIED, "team.agents.solver.model.preset=tiny-1m",
                                        "team.agents.solver.sampling.max_new_tokens=24",
                                        "workload.params.max_steps=4"]),
    # Program teams: their calls go through the endpoint; sync runs one whole-batch program op,
    # so its decode batches differ from the co-design's per-micro-batch ones (see ADAM_ROUNDING).
    "program": ("program_team.yaml", VARIED),
    "program_retry": ("program_retry.yaml", VARIED),  # 1-3 calls of each agent per trajectory
}
#: Program teams decode in batches of other sizes under sync and co-design, so the behaviour
#: log-probs of the same tokens differ in their last float32 bits, and so do the losses (seen:
#: 1e-7 relative). Adam divides a gradient by its own root mean square: where a gradient is at
#: that rounding level its step can differ by up to 2 lr. Such elements are allowed, as long as
#: they are rare (seen: 1 of 1.25M) and within that bound.
ADAM_ROUNDING = {"program": 1e-5, "program_retry": 1e-5}

#: the agents whose weights must move in two iterations (default: all)
TRAINED = {"code": set()}


def threaded_run(config: str, overrides: list[str], run_dir: Path, codesign: bool) -> tuple[ExperimentConfig, dict[str, Any]]:
    """`config` with `overrides` through `run.train` on a `ThreadExecutor` with the config's
    workers and tags; every co-design switch on (`codesign`) or off."""
    cfg = load_config(config, [f"run_dir={run_dir}", *overrides,
                               *[f"codesign.{s}={str(codesign).lower()}" for s in SWITCHES]])
    folder = run.prepare_run(cfg, log=lambda _: None)
    ex = ThreadExecutor(stage_fn(str(folder)), {w.name: dict(w.resources) for w in cfg.cluster.workers})
    try:
        return cfg, run.train(cfg, folder, ex)
    finally:
        ex.close()


def assert_same_runs(a: ExperimentConfig, b: ExperimentConfig, columns: list[str],
                     trained: set[str] | None = None, adam_rounding: float = 0.0) -> None:
    """Same samples (ids, versions, tokens exactly; rewards to float32 resolution) for every
    agent and iteration, every one trained on, and the same final weights, which moved for
    the agents in `trained` (default: every trainable one); `adam_rounding`: the share of
    elements that may differ by up to Adam's bound instead (`ADAM_ROUNDING`)."""
    meg = MEG.from_config(a.team)
    stores = [MEGStore(c.resolved_store_uri()) for c in (a, b)]
    for it in range(ITERATIONS):
        for agent in meg.agent_names:
            ra, rb = (s.read_samples(agent, it).select([*columns, "reward", "consumed_step"])
                      .sort_by("sample_id").to_pylist() for s in stores)
            assert len(ra) == len(rb) > 0, (agent, it)
            for x, y in zip(ra, rb, strict=True):
                assert {c: x[c] for c in columns} == {c: y[c] for c in columns}, (agent, it, x["sample_id"])
                assert x["reward"] == pytest.approx(y["reward"], rel=1e-6)
                assert x["consumed_step"] is not None and y["consumed_step"] is not None
    trained = set(meg.trainable_agents) if trained is None else trained
    for agent in meg.trainable_agents:
        wa, wb = (load_file(str(weights_path(Path(c.resolved_run_dir()), agent, ITERATIONS))) for c in (a, b))
        w0 = load_file(str(weights_path(Path(a.resolved_run_dir()), agent, 0)))
        assert agent not in trained or any(not torch.equal(wa[k], w0[k]) for k in wa), f"{agent} did not train"
        if adam_rounding:
            lr = a.agent(agent).algorithm.lr
            off = [(wb[k] - wa[k]).abs()[~torch.isclose(wb[k], wa[k], rtol=1e-4, atol=1e-6)] for k in wa]
            n_off, n = sum(o.numel() for o in off), sum(v.numel() for v in wa.values())
            assert n_off <= adam_rounding * n, f"{agent}: {n_off} of {n} elements differ"
            assert all(o.numel() == 0 or o.max() <= 2 * lr * ITERATIONS for o in off), agent
            continue
        for k in wa:
            # Same samples, another accumulation order across workers: float32 sums of weights
            # of magnitude ~0.1-1 after two Adam steps of lr 1e-4.
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=f"{agent}.{k}")


@pytest.fixture(scope="module")
def tool_init(tmp_path_factory) -> tuple[Path, float]:
    """Starting weights for the tool team: a solver that writes the calculator's `]` with
    probability >= `floor` after any token at the team's sampling temperature (crafted, see
    `calling_model`), and a plain planner."""
    cfg = load_config(str(CONFIGS / "tool_team.yaml"), [])
    calc = make_workload(cfg.workload, cfg.team).tool("solver")
    solver = calling_model(calc.close, gap=0.3)
    temperature = next(a.sampling.temperature for a in cfg.team.agents if a.name == "solver")
    floor = calling_floor(solver, tokenizer().encode(calc.close, add_special_tokens=False)[0], temperature)
    init = tmp_path_factory.mktemp("tool-init")
    save_state_atomic(init / "solver" / "model.safetensors", solver.state_dict())
    save_state_atomic(init / "planner" / "model.safetensors", tiny_model(seed=3).state_dict())
    return init, floor


@pytest.mark.parametrize("team", sorted(TEAMS))
def test_codesign_equals_sync_on_each_team(team, tmp_path, request):
    config, overrides = TEAMS[team]
    overrides = [*SMALL, *overrides]
    if team == "tool":
        init, _ = request.getfixturevalue("tool_init")
        overrides.append(f"train.init_from={init}")
    cols = ["sample_id", "policy_version", "prompt_ids", "response_ids"]
    if team == "tool":
        cols += ["loss_mask", "response_text"]
    runs = {mode: threaded_run(str(CONFIGS / config), overrides, tmp_path / mode, mode == "codesign")
            for mode in ("sync", "codesign")}
    (sync, sync_out), (codesign, co_out) = runs["sync"], runs["codesign"]
    for out in (sync_out, co_out):
        assert [m["iteration"] for m in out.iterations] == list(range(ITERATIONS))
    # Where the team's own reward is flat for untrained models no advantage moves a weight, and
    # the samples and rewards carry the check: an untrained coder's programs fail in the
    # sandbox (every code-team reward 0), a random planner never names the first operation.
    assert_same_runs(sync, codesign, cols, TRAINED.get(team), ADAM_ROUNDING.get(team, 0.0))
    if team == "tool":
        check_tool_rows(sync, request.getfixturevalue("tool_init")[1])
    if team == "code":
        check_code_rewards(sync)
        from flexmarl_core.stages import evaluate

        held = evaluate(str(sync.resolved_run_dir()), ITERATIONS)  # sandboxed, greedy
        assert held["heldout_n"] == 8 and 0.0 <= held["heldout_accuracy"] <= 1.0


def check_tool_rows(cfg: ExperimentConfig, floor: float) -> None:
    """The solver's calculator calls ran inside the rollouts: each masked run of a stored row
    is the calculator's answer to the call just before it, with logprob 0; the stored rewards
    are what the workload gives here (the final round for the last turn; under turn_credit the
    solver's round 0 for its own reduction). Calls happen by construction: a row of 24 tokens
    writes no `]` with probability below (1 - floor)^24."""
    meg = MEG.from_config(cfg.team)
    workload = make_workload(cfg.workload, cfg.team)
    calc = workload.tool("solver")
    tok = tokenizer()
    store = MEGStore(cfg.resolved_store_uri())
    assert floor > 0.3 and workload.params.turn_credit
    inserted = 0
    for it in range(ITERATIONS):
        inputs = {r["input_id"]: r for r in store.read_inputs(it).to_pylist()}
        finals: dict[tuple[str, int], dict[str, str]] = {}
        turns: dict[tuple[str, int, str], list[tuple[str, float]]] = {}
        for agent in meg.agent_names:
            rows = store.read_samples(agent, it).to_pylist()
            assert len(rows) == 4 * 2 * (2 if agent == "solver" else 1)  # inputs x group x rounds
            for r in rows:
                mask = r["loss_mask"]
                if agent == "planner" or mask is None:
                    assert agent == "solver" or mask is None
                    continue
                assert len(mask) == len(r["response_ids"]) == len(r["logprobs"])
                ids = r["response_ids"]
                for start, end in _runs(mask):
                    assert tok.decode(ids[start:end]) == calc(call_before(tok, ids, start, calc))
                    assert r["logprobs"][start:end] == [0.0] * (end - start)
                    inserted += end - start
            # Each agent's last turn is what the reward scores (the planner runs in round 0 only).
            for r in sorted(rows, key=lambda r: int(r["sample_id"].rsplit(":", 1)[1])):
                input_id, traj, _, _ = r["sample_id"].split(":")
                finals.setdefault((input_id, int(traj)), {})[agent] = r["response_text"]
                turns.setdefault((input_id, int(traj), agent), []).append((r["response_text"], r["reward"]))
        for (input_id, traj), outs in finals.items():
            inp = inputs[input_id]
            meta = inp["meta"] if isinstance(inp["meta"], dict) else json.loads(inp["meta"])
            final = workload.reward(Problem(input_id, inp["text"], inp["answer"], meta), outs)
            for agent in meg.agent_names:
                texts, got = zip(*turns[(input_id, traj, agent)], strict=True)
                problem = Problem(input_id, inp["text"], inp["answer"], meta)
                assert list(got) == pytest.approx(workload.turn_rewards(problem, agent, list(texts), final[agent]))
                assert got[-1] == pytest.approx(final[agent])
    assert inserted > 0


def check_code_rewards(cfg: ExperimentConfig) -> None:
    """The reward stage's sandboxed judgement of every stored coder/tester pair is what the
    same judgement gives here."""
    store = MEGStore(cfg.resolved_store_uri())
    workload = make_workload(cfg.workload, cfg.team)
    for it in range(ITERATIONS):
        inputs = {r["input_id"]: r for r in store.read_inputs(it).to_pylist()}
        outputs: dict[tuple[str, int], dict[str, str]] = {}
        stored: dict[tuple[str, int], dict[str, float]] = {}
        for agent in ("coder", "tester"):
            for r in store.read_samples(agent, it).to_pylist():
                outputs.setdefault((r["input_id"], r["traj"]), {})[agent] = r["response_text"]
                stored.setdefault((r["input_id"], r["traj"]), {})[agent] = r["reward"]
        assert len(stored) == 4 * 2
        for (input_id, traj), outs in outputs.items():
            inp = inputs[input_id]
            meta = inp["meta"] if isinstance(inp["meta"], dict) else json.loads(inp["meta"])
            problem = Problem(input_id, inp["text"], inp["answer"], meta)
            assert workload.reward(problem, outs) == pytest.approx(stored[(input_id, traj)])
