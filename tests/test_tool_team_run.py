"""The tool team through the real run: the Prefect flow on a real Dask cluster, the solver's
calculator calls run inside the workers' rollouts, the inserted tokens stored masked, and the
co-design producing exactly the synchronous run's samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from flexmarl_core.worker import save_state_atomic, weights_path
from flexmarl_core.workloads import Problem, make_workload
from storage import MEGStore
from tests._models_util import tiny_model, tokenizer
from tests.test_tool_team import _overfit_solver, _runs

REPO = Path(__file__).resolve().parents[1]
TOOL = str(REPO / "configs" / "tool_team.yaml")
SWITCHES = ["dependency_parallel", "load_balancing", "async_pipeline", "on_demand_allocation"]
ITERATIONS = 2


@pytest.mark.slow
def test_tool_team_runs_the_calculator_in_the_workers_and_codesign_equals_sync(
        prefect_api, dask_cluster, tmp_path):
    from flows.train import train

    # Start from a solver that calls the calculator (a fresh one almost never writes "]").
    _, _, solver, _ = _overfit_solver()
    init = tmp_path / "init"
    save_state_atomic(init / "solver" / "model.safetensors", solver.state_dict())
    save_state_atomic(init / "planner" / "model.safetensors", tiny_model(seed=3).state_dict())
    cfgs = {}
    for mode in ("sync", "codesign"):
        overrides = [f"run_dir={tmp_path / mode}", f"cluster.address={dask_cluster}",
                     "cluster.prefect_lean=true", f"train.iterations={ITERATIONS}",
                     f"train.init_from={init}", "train.evaluate_initial=false",
                     "workload.heldout_size=8", "batch.inputs_per_iteration=4",
                     "batch.group_size=2", "batch.micro_batch_inputs=2",
                     *[f"codesign.{s}={'false' if mode == 'sync' else 'true'}" for s in SWITCHES]]
        state = train(TOOL, overrides, progress=False, return_state=True)
        assert state.is_completed(), state.message
        cfgs[mode] = load_config(TOOL, overrides)

    cfg = cfgs["sync"]
    meg = MEG.from_config(cfg.team)
    workload = make_workload(cfg.workload, cfg.team)
    calc = workload.tool("solver")
    tok = tokenizer()
    stores = {m: MEGStore(c.resolved_store_uri()) for m, c in cfgs.items()}
    cols = ["sample_id", "policy_version", "prompt_ids", "response_ids", "logprobs", "loss_mask",
            "response_text", "reward"]
    inserted = 0
    for it in range(ITERATIONS):
        inputs = {r["input_id"]: r for r in stores["sync"].read_inputs(it).to_pylist()}
        finals: dict[tuple[str, int], dict[str, str]] = {}
        turns: dict[tuple[str, int, str], list[tuple[str, float]]] = {}
        for agent in meg.agent_names:
            a, b = (stores[m].read_samples(agent, it).select(cols).sort_by("sample_id").to_pylist()
                    for m in ("sync", "codesign"))
            assert len(a) == 4 * 2 * (2 if agent == "solver" else 1)  # inputs x group x rounds
            for ra, rb in zip(a, b, strict=True):
                # Same samples, inserted tokens and masks in both schedules.
                for c in ("sample_id", "policy_version", "prompt_ids", "response_ids", "loss_mask",
                          "response_text"):
                    assert ra[c] == rb[c], (it, agent, c)
                assert ra["reward"] == pytest.approx(rb["reward"], rel=1e-6)
            for r in a:
                mask = r["loss_mask"]
                if agent == "planner":
                    assert mask is None
                    continue
                if mask is None:
                    continue
                assert len(mask) == len(r["response_ids"]) == len(r["logprobs"])
                # Every masked run is the calculator's answer to the call just before it.
                ids = r["response_ids"]
                for start, end in _runs(mask):
                    before = tok.decode(ids[:start])
                    assert before.endswith("]")
                    assert tok.decode(ids[start:end]) == calc(before[before.rfind("[") + 1 : -1])
                    assert r["logprobs"][start:end] == [0.0] * (end - start)
                    inserted += end - start
            # Each agent's last turn is what the reward scores (the planner runs in round 0 only).
            for r in sorted(a, key=lambda r: int(r["sample_id"].rsplit(":", 1)[1])):
                input_id, traj, _, _ = r["sample_id"].split(":")
                finals.setdefault((input_id, int(traj)), {})[agent] = r["response_text"]
                turns.setdefault((input_id, int(traj), agent), []).append(
                    (r["response_text"], r["reward"]))
        # The workers' rewards are what the workload gives here: the final round's outputs for
        # the last turn, and under turn_credit the solver's round 0 for its own reduction.
        for (input_id, traj), outs in finals.items():
            inp = inputs[input_id]
            meta = inp["meta"] if isinstance(inp["meta"], dict) else json.loads(inp["meta"])
            problem = Problem(input_id, inp["text"], inp["answer"], meta)
            final = workload.reward(problem, outs)
            for agent in meg.agent_names:
                texts, got = zip(*turns[(input_id, traj, agent)], strict=True)
                want = workload.turn_rewards(problem, agent, list(texts), final[agent])
                assert list(got) == pytest.approx(want)
                assert got[-1] == pytest.approx(final[agent])
    assert workload.params.turn_credit  # the config under test pays round 0 for its own turn
    assert inserted > 0
    for agent in meg.trainable_agents:
        wa, wb = (load_file(str(weights_path(Path(c.resolved_run_dir()), agent, ITERATIONS)))
                  for c in cfgs.values())
        for k in wa:
            # Same samples, different accumulation order across workers: float32 sums.
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=f"{agent}.{k}")
