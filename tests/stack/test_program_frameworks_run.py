"""Agent programs as the mainstream frameworks write them, through the real training flow
(Prefect flow, the shared Dask workers, the endpoint in each worker): LangGraph's ReAct agent
with a tool, an Agents SDK handoff, a LangGraph team that streams and takes structured output,
and an Agents SDK agent on its default Responses model, streamed, with a typed output. Each
commits exactly what its program ops recorded (the run's audit is clean), and its samples
show the feature on the wire: tools rendered, a handoff taken, JSON of the schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl_core.config import load_config
from flexmarl_core.driver.audit import audit_run
from storage import MEGStore

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.iterations=1", "train.warm_start=none", "train.evaluate=false", "train.evaluate_initial=false",
         "batch.inputs_per_iteration=4", "batch.group_size=2", "batch.micro_batch_inputs=2",
         "workload.heldout_size=8", "cluster.prefect_lean=true"]


def _json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


#: config -> (agent, what each of its samples shows)
CASES = {
    "program_react.yaml": ("solver", lambda r: "# Tools" in r["prompt_text"] and '"calculator"' in r["prompt_text"]),
    "program_handoff.yaml": ("planner", lambda r: '"transfer_to_solver"' in r["prompt_text"]),
    # an untrained model's JSON may run past max_new_tokens: most, not all, end as JSON
    "program_structured.yaml": ("solver", lambda r: r["response_text"].lstrip().startswith("{")),
    "program_responses.yaml": ("solver", lambda r: r["response_text"].lstrip().startswith("{")),
}


@pytest.mark.parametrize("config", sorted(CASES))
def test_a_framework_program_trains_through_the_flow(config, dask_cluster, tmp_path):
    from flows.train import train

    run_dir = tmp_path / "run"
    state = train(str(REPO / "configs" / config), [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *SMALL],
                  progress=False, return_state=True)
    assert state.is_completed(), state.message
    assert audit_run(str(run_dir))[1] == []
    cfg = load_config(run_dir / "config.yaml")
    agent, shows = CASES[config]
    rows = MEGStore(cfg.resolved_store_uri()).read_samples(agent, 0).to_pylist()
    assert rows and all(shows(r) for r in rows), rows[0]["prompt_text"][-400:] if rows else "no samples"
    if config in ("program_structured.yaml", "program_responses.yaml"):
        ended = [r for r in rows if r["response_text"].rstrip().endswith("}")]
        assert ended and all(_json(r["response_text"]) for r in ended)
