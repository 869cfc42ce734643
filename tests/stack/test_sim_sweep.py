"""A simulator sweep as a Prefect flow: each point a Prefect task run on Dask (the simulator
itself: tests/unit/test_sim.py)."""

from __future__ import annotations

from pathlib import Path

from flexmarl_core.sim.study import CODESIGN, SYNC

SIM = Path(__file__).resolve().parents[2] / "configs" / "sim"
MATH = SIM / "math-3x14b.yaml"
PAPER = SIM / "paper-48x16.yaml"
SMALL = ["nodes=6", "inference.nodes=4", "training.nodes=2", "training.group_devices=16"]


def test_sweep_runs_each_point_as_a_prefect_task_on_dask(prefect_api):
    import httpx

    from flows.simulate import sweep

    state = sweep(str(MATH), str(PAPER), "sim.inference.nodes=3,4",
                  [*(f"sim.{o}" for o in SMALL), "train.iterations=1"], return_state=True)
    out = state.result()
    assert out["label"] == "simulated"
    assert [(p["overrides"][-1], p["mode"]) for p in out["points"]] == [
        (f"sim.inference.nodes={n}", m) for n in (3, 4) for m in (SYNC, CODESIGN)]
    by_nodes = {(p["overrides"][-1], p["mode"]): p["e2e_s_per_iteration"] for p in out["points"]}
    assert by_nodes[("sim.inference.nodes=3", SYNC)] > by_nodes[("sim.inference.nodes=4", SYNC)]
    runs = httpx.post(f"{prefect_api}/task_runs/filter", json={
        "flow_runs": {"id": {"any_": [str(state.state_details.flow_run_id)]}}}).json()
    assert len(runs) == 4 and all(r["name"].startswith("simulate-point") for r in runs)
    assert all(r["state_type"] == "COMPLETED" for r in runs)
