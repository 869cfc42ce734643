"""The code team through the real run: the Prefect flow on a real Dask cluster, the coder's
programs judged by the sandbox inside the workers' reward stage."""

from __future__ import annotations

import json
import time
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


HOSTILE_CODERS = [
    "__import__('os').fork()",
    "__import__('time').sleep(60)",
    "[bytearray(1 << 26) for _ in range(100)]",
    "__import__('os').kill(__import__('os').getppid(), 9)",  # the parent is the Dask worker
    "__import__('os')._exit(0)",
    "[0 for _ in iter(int, 1)]",
]


@pytest.mark.slow
def test_hostile_programs_in_the_workers_score_zero_and_the_workers_live(dask_cluster):
    """The reward stage's sandbox inside real Dask workers: every hostile program scores 0
    within its limits, no worker dies, and the same workers then judge a right program."""
    import distributed

    cfg = load_config(CODE, [])
    workload = make_workload(cfg.workload, cfg.team)
    problem = workload.problems("train", 1, seed=0)[0]

    def reward(code: str) -> dict[str, float]:
        return workload.reward(problem, {"coder": code, "tester": ""})

    with distributed.Client(dask_cluster) as client:
        before = set(client.scheduler_info(n_workers=-1)["workers"])
        t0 = time.monotonic()
        results = client.gather(client.map(reward, HOSTILE_CODERS, pure=False))
        assert time.monotonic() - t0 < 30
        assert [r["coder"] for r in results] == [0.0] * len(HOSTILE_CODERS)
        assert set(client.scheduler_info(n_workers=-1)["workers"]) == before
        assert client.submit(reward, problem.answer, pure=False).result()["coder"] == 1.0
