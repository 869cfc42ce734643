"""The code team through the real run: the Prefect flow on a real Dask cluster, the coder's
programs judged by the sandbox inside the workers' reward stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.workloads import Problem, make_workload
from storage import MEGStore

REPO = Path(__file__).resolve().parents[1]
CODE = str(REPO / "configs" / "code_team.yaml")


@pytest.mark.slow
def test_code_team_trains_with_sandboxed_rewards(prefect_api, dask_cluster, tmp_path):
    from flows.train import train

    overrides = [f"run_dir={tmp_path / 'run'}", f"cluster.address={dask_cluster}",
                 "cluster.prefect_lean=true", "train.iterations=2", "train.warm_start=none",
                 "train.evaluate_initial=false", "workload.heldout_size=8",
                 "batch.inputs_per_iteration=4", "batch.group_size=2", "batch.micro_batch_inputs=2",
                 "team.agents.coder.model.preset=tiny-1m", "team.agents.tester.model.preset=tiny-1m"]
    state = train(CODE, overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message
    cfg = load_config(CODE, overrides)
    store = MEGStore(cfg.resolved_store_uri())
    workload = make_workload(cfg.workload, cfg.team)
    for it in range(2):
        inputs = {r["input_id"]: r for r in store.read_inputs(it).to_pylist()}
        outputs: dict[tuple[str, int], dict[str, str]] = {}
        stored: dict[tuple[str, int], dict[str, float]] = {}
        for agent in ("coder", "tester"):
            for r in store.read_samples(agent, it).to_pylist():
                outputs.setdefault((r["input_id"], r["traj"]), {})[agent] = r["response_text"]
                stored.setdefault((r["input_id"], r["traj"]), {})[agent] = r["reward"]
        assert len(stored) == 4 * 2
        # The workers' sandboxed rewards are what the same judgement gives here.
        for (input_id, traj), outs in outputs.items():
            inp = inputs[input_id]
            meta = inp["meta"] if isinstance(inp["meta"], dict) else json.loads(inp["meta"])
            problem = Problem(input_id, inp["text"], inp["answer"], meta)
            assert workload.reward(problem, outs) == pytest.approx(stored[(input_id, traj)])
    summary = state.result()["summary"]
    assert 0.0 <= summary["heldout_accuracy"] <= 1.0
