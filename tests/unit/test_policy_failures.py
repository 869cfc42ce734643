"""A trajectory the model broke is trained, with `team.failure_reward`, through the real stages
and endpoint on the in-process ThreadExecutor: a planner whose answer is not JSON, the Agents
SDK's `incomplete` answer at the token limit, LangGraph's recursion limit, a LangGraph agent
ending on a tool call that does not parse. A bug of the
program's own (a `TypeError`) is still dropped, and stops the run when every trajectory hits it.
(The models are untrained: they never write a JSON object, never finish within 12 tokens, never
say "done" in a handful; the checks hold whichever trajectories do.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.programs.manifest import read_manifest
from storage import MEGStore
from tests._runs import train_on_threads

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = ["train.iterations=1", "train.evaluate=false", "train.evaluate_initial=false", "train.warm_start=none",
         "workload.heldout_size=8", "batch.inputs_per_iteration=4", "batch.group_size=2", "batch.micro_batch_inputs=2"]


def _run(config: str, tmp_path: Path, *overrides: str):
    cfg = load_config(str(CONFIGS / config), [f"run_dir={tmp_path / 'run'}", *SMALL, *overrides])
    return cfg, *train_on_threads(cfg)


def _check_broken_are_trained(cfg, folder, out, types: set[str], reward: float) -> int:
    """Every trajectory the policy broke is in its manifest as trained, of one of `types`; its
    samples are in the store with `reward` and its type; the iteration counts them."""
    loc, store = cfg.run_location(), MEGStore(cfg.resolved_store_uri())
    broke = [f for mb in range(2) for f in read_manifest(loc, 0, mb)["failed"]]
    assert broke and all(f.get("trained") and f["policy_error"] in types for f in broke), broke
    keys = {(f["input_id"], f["traj"]) for f in broke}
    rows = [r for a in cfg.team.agents for r in store.read_samples(a.name, 0).to_pylist()
            if (r["input_id"], r["traj"]) in keys]
    assert rows and all(r["reward"] == pytest.approx(reward) and r["consumed_step"] == 0 for r in rows)
    for r in rows:  # the answer's own sampled tokens are trained, each with its behaviour log-prob
        n = len(r["response_ids"])
        assert n > 0 and len(r["logprobs"]) == n and (r["loss_mask"] is None or (len(r["loss_mask"]) == n
                                                                                and sum(r["loss_mask"]) > 0))
    assert all(json.loads(r["extra"])["policy_error"] in types for r in rows)
    m = out.iterations[0]
    assert m["team/program/policy_failed"] == len(broke) == sum(m[f"team/program/policy_failed/{t}"] for t in types
                                                                  if f"team/program/policy_failed/{t}" in m)
    assert m["failed_trajectories"] == 0
    assert audit_run(str(folder))[1] == []
    return len(broke)


def test_a_plan_that_is_not_json_is_trained_with_the_failure_reward(tmp_path):
    cfg, folder, out = _run("program_team.yaml", tmp_path, "team.program=tests.program_teams:json_plan",
                            "team.failure_reward=-0.5", "workload.credit=team")
    _check_broken_are_trained(cfg, folder, out, {"JSONDecodeError", "PolicyFailure"}, -0.5)


def test_an_agents_sdk_answer_cut_at_its_limit_is_trained(tmp_path):
    pytest.importorskip("agents", reason="openai-agents is a dev dependency")
    cfg, folder, out = _run("program_sdk_plain.yaml", tmp_path)
    n = _check_broken_are_trained(cfg, folder, out, {"ModelBehaviorError"}, cfg.team.failure_reward)
    assert n == 8  # every trajectory: an untrained planner never stops within 12 tokens


def test_langgraphs_recursion_limit_is_the_policys_failure(tmp_path):
    pytest.importorskip("langgraph", reason="langgraph is a dev dependency")
    cfg, folder, out = _run("program_team.yaml", tmp_path, "team.program=tests.program_teams:langgraph_until_done",
                            "workload.credit=team")
    _check_broken_are_trained(cfg, folder, out, {"GraphRecursionError"}, 0.0)


def test_a_tool_call_that_does_not_parse_ends_langgraphs_agent_and_is_the_policys_failure(tmp_path):
    pytest.importorskip("langgraph", reason="langgraph is a dev dependency")
    cfg, folder, out = _run("program_react.yaml", tmp_path, "team.program=tests.program_teams:langgraph_forced_tool",
                            "team.failure_reward=-1.0", "team.agents.0.sampling.max_new_tokens=16")
    # a call that did parse would loop to the recursion limit: the policy's failure as well
    n = _check_broken_are_trained(cfg, folder, out, {"MalformedToolCall", "GraphRecursionError"}, -1.0)
    assert out.iterations[0].get("team/program/policy_failed/MalformedToolCall", 0) > 0 and n == 8


def test_a_bug_of_the_program_is_dropped_and_stops_the_run_when_every_trajectory_hits_it(tmp_path):
    with pytest.raises(Exception, match=r"every trajectory of team.program 'tests.program_teams:type_error' "
                                        r"failed.*TypeError"):
        _run("program_team.yaml", tmp_path, "team.program=tests.program_teams:type_error")


def test_a_type_the_config_names_is_the_policys(tmp_path):
    cfg, folder, out = _run("program_team.yaml", tmp_path, "team.program=tests.program_teams:type_error",
                            "team.policy_errors=[TypeError]", "team.failure_reward=-1.0", "workload.credit=team")
    _check_broken_are_trained(cfg, folder, out, {"TypeError"}, -1.0)
