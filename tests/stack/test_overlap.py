"""Generation beside training on one machine (`cluster.workers: auto` with
`codesign.max_staleness: 1`): the layout gives the agent a worker for its rollouts and one for
its training, a rollout of the next iteration runs while the agent's training is held, and the
behaviour log-probs it records, which `decoupled_ppo` corrects with, are the log-probs of the
weights version that sampled them (teacher-forced again here: equal to float32 tolerance)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flexmarl_core.config import load_config

REPO = Path(__file__).resolve().parents[2]
OVERHEAD = str(REPO / "configs" / "overhead.yaml")
OVERLAP = ["train.iterations=3", "train.evaluate=false", "train.checkpoint_every=3", "cluster.prefect_lean=true",
           "workload.reward=tests.reward_fns:varied", "workload.credit=team",  # every group has spread: a step moves the weights
           "codesign.max_staleness=1", "team.agents.solver.algorithm.policy_loss=decoupled_ppo",
           "cluster.workers=auto", "cluster.torch_threads=auto"]
HELD, AHEAD = "train[solver] it=1 mb=0", "rollout[solver] it=2 mb=0"


def teacher_forced(model: torch.nn.Module, row: dict, temperature: float) -> list[float]:
    ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    n, r = len(row["prompt_ids"]), row["response_ids"]
    lp = torch.log_softmax(logits[n - 1:n - 1 + len(r)], dim=-1)
    return lp.gather(1, torch.tensor(r)[:, None])[:, 0].tolist()


def test_next_rollout_runs_while_training_is_held_and_its_logprobs_are_its_versions(prefect_api, tmp_path):
    from safetensors.torch import load_file

    from flexmarl_core.driver.audit import audit_run
    from flexmarl_core.models import load_agent_model
    from flexmarl_core.runfiles.location import weights_key
    from flows.train import train
    from storage import MEGStore
    from tests._holds import Holds
    from tests._runs import ops_log

    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", *OVERLAP]
    cfg = load_config(OVERHEAD, overrides)
    assert len(cfg.cluster.workers) == 2 and "beside its training" in cfg.cluster.layout

    v1 = run_dir / weights_key("solver", 1)
    kept = tmp_path / "v1.safetensors"

    def ahead_done(_: set[str]) -> bool:
        try:
            done = AHEAD in {o["op"] for o in ops_log(run_dir)}
        except (FileNotFoundError, ValueError):  # not written yet, or a line half-written
            return False
        if done:  # the version it sampled with, kept before retention drops it
            shutil.copyfile(v1, kept)
        return done

    with Holds(run_dir, [HELD], ahead_done) as held:
        state = train(OVERHEAD, overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message
    # the next iteration's rollout ended while the agent's training was held: they overlap
    assert held.seen == {HELD}
    ops = {o["op"]: o for o in ops_log(run_dir)}
    assert ops[AHEAD]["t_end"] <= ops[HELD]["t_end"] and ops[AHEAD]["worker"] != ops[HELD]["worker"]
    assert audit_run(str(run_dir)).verdict() == "clean"

    rows = MEGStore(str(run_dir / "store")).read_samples("solver", 2, mb=0).to_pylist()
    assert rows and {r["policy_version"] for r in rows} == {1}  # one behind the update that trains on it
    agent = cfg.team.agents[0]
    model, _ = load_agent_model(agent.model, seed=cfg.seed)
    v0, _ = load_agent_model(agent.model, seed=cfg.seed)  # the run's start: version 0
    model.load_state_dict(load_file(str(kept)))
    model.eval(), v0.eval()
    # the check tells the versions apart: one step moved these log-probs well past its tolerance
    assert max(abs(a - b) for r in rows for a, b in zip(teacher_forced(v0, r, agent.sampling.temperature),
                                                        r["logprobs"], strict=True)) > 1e-3
    for r in rows:
        # fp32 logits of a 1M-parameter model, decoded with a KV cache there and in one forward
        # here: the sums differ in order only, far below 1e-4 at log-probs of magnitude <= ~10
        assert teacher_forced(model, r, agent.sampling.temperature) == pytest.approx(r["logprobs"], abs=1e-4), r["sample_id"]
