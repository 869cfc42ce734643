"""The real stack end to end: the Prefect flow on a session Prefect API and a real Dask cluster,
the MEG Store on disk, real models trained on CPU."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl_core.cluster import workers_info
from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.runtime.worker import weights_path
from storage import MEGStore

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


async def _task_runs(flow_run_id):
    from tests._runs import task_runs

    return await task_runs(flow_run_id)


SWITCHES = ["dependency_parallel", "load_balancing", "async_pipeline", "on_demand_allocation"]
ITERATIONS = 3
# Dedicated instances (static in the sync run, moved by the balancer in the co-design run).
DEDICATED = {"w0": {"rollout": 0, "rollout:planner": 1, "rollout:verifier": 1, "train": 1},
             "w1": {"rollout": 0, "rollout:solver": 1, "train": 1}}


def _retag(address: str, tags: dict[str, dict[str, float]]) -> None:
    import distributed

    from flexmarl_core.cluster import set_worker_resources, worker_resources

    with distributed.Client(address) as client:
        by_name = {info["name"]: addr for addr, info in workers_info(client).items()}
        for name, res in tags.items():
            # Zero every tag first: the balancer may have added others during the run.
            current = worker_resources(client)[by_name[name]]
            set_worker_resources(client, by_name[name], {**{k: 0.0 for k in current}, **res})


@pytest.fixture(scope="module")
def runs(prefect_api, dask_cluster, tmp_path_factory):
    """The same work and seed, all switches off and all on, on dedicated instances."""
    from flows.train import train

    out = {}
    _retag(dask_cluster, DEDICATED)
    try:
        for mode in ("sync", "codesign"):
            run_dir = tmp_path_factory.mktemp(mode) / "run"
            # A reward that varies for untrained models, so every agent gets a gradient.
            overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}",
                         "cluster.prefect_lean=true", "workload.reward=tests.reward_fns:varied",
                         "workload.credit=team", f"train.iterations={ITERATIONS}"]
            overrides += [f"codesign.{s}={'false' if mode == 'sync' else 'true'}" for s in SWITCHES]
            state = train(TINY, overrides, progress=False, return_state=True)
            out[mode] = (state, overrides)
    finally:
        _retag(dask_cluster, {"w0": {"rollout": 1, "train": 1}, "w1": {"rollout": 1, "train": 1}})
    return out


@pytest.mark.parametrize("mode", ["sync", "codesign"])
def test_train_flow_end_to_end(runs, mode):
    state, overrides = runs[mode]
    assert state.is_completed(), state.message
    out = state.result()
    cfg = load_config(TINY, overrides)
    meg = MEG.from_config(cfg.team)
    plan = Plan.build(cfg)

    # Every task run completed: one per op of the graph, plus warm-start, prepare-run, evaluate, report, pictures.
    # The server records task runs from events in batches: poll briefly.
    deadline = time.time() + 30
    while True:
        runs = asyncio.run(_task_runs(state.state_details.flow_run_id))
        if len(runs) >= len(plan.ops()) + 5 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(runs) == len(plan.ops()) + 5
    assert all(r.state.is_completed() for r in runs), [r.name for r in runs if not r.state.is_completed()]
    names = {r.name for r in runs}
    assert "rollout[solver] it=1 mb=1" in names and "train[verifier] it=0 mb=0" in names

    # The store holds exactly the expected samples, and iteration k was made by version k.
    store = MEGStore(cfg.resolved_store_uri())
    for it in range(cfg.train.iterations):
        ids = [p["input_id"] for p in store.read_inputs(it).to_pylist()]
        expected = {n.sample_id for n in meg.instantiate(ids, cfg.batch.group_size)}
        for agent in meg.agent_names:
            tbl = store.read_samples(agent, it)
            got = tbl.column("sample_id").to_pylist()
            assert len(got) == len(set(got))
            assert set(got) == {s for s in expected if s.split(":")[2] == agent}
            assert set(tbl.column("policy_version").to_pylist()) == {it}
            assert tbl.column("consumed_step").null_count == 0  # every sample was trained on
        assert not store.audit(agent, it, expected=[s for s in expected if s.split(":")[2] == agent])

    # Each trained agent's weights changed and its version advanced to `iterations`.
    run_dir = Path(cfg.resolved_run_dir())
    for agent in meg.trainable_agents:
        w0 = load_file(str(weights_path(run_dir, agent, 0)))
        wn = load_file(str(weights_path(run_dir, agent, cfg.train.iterations)))
        assert any(not (w0[k] == wn[k]).all() for k in w0), f"{agent}: weights did not change"

    # Metrics: one line per iteration, TensorBoard events, a summary with the overhead figure.
    lines = (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == list(range(cfg.train.iterations))
    assert list((run_dir / "metrics" / "tensorboard").glob("events.out.tfevents.*"))
    s = out["summary"]
    assert 0 < s["utilization"] <= 1.0 and s["tokens_per_s"] > 0
    assert 0 <= s["prefect_overhead_frac"] < 1
    m0 = out["iterations"][0]
    assert {"e2e_s", "tokens", "stage_s/rollout", "stage_s/train", "agent/solver/reward"} <= set(m0)

    # Control-plane decisions: none in the synchronous baseline; in the co-design run a
    # training slot per (agent, iteration) and instance moves toward the planner, whose two
    # micro-batches wait on one instance at the start.
    decisions = [json.loads(x) for x in (run_dir / "metrics" / "decisions.jsonl").read_text().splitlines()]
    if mode == "sync":
        assert decisions == []
    else:
        slots = [d for d in decisions if d["decision"] == "train_slot"]
        assert len(slots) == len(meg.trainable_agents) * cfg.train.iterations
        moves = [d for d in decisions if d["decision"] == "move_instance"]
        assert any(d["to_agent"] == "planner" for d in moves), decisions
        # Every step checkpointed the trainer state (the swap tier); the run kept the newest
        # (driver/retention.py), and of the weights the initial and the final versions (k = 0).
        for agent in meg.trainable_agents:
            kept = sorted(p.name for p in (run_dir / "trainers" / agent).glob("v*.state"))
            assert kept == [f"v{cfg.train.iterations}.state"]
            weights = sorted(p.name for p in (run_dir / "weights" / agent).glob("v*.safetensors"))
            assert weights == ["v0.safetensors", f"v{cfg.train.iterations}.safetensors"]
    assert all(m["swap_out_bytes"] > 0 for m in out["iterations"])


@pytest.mark.parametrize("mode", ["sync", "codesign"])
def test_each_iteration_says_where_its_steps_went(runs, mode):
    """Per agent and iteration: forward+backward (timed inside the train ops, so never more
    than their seconds), the step's and the sync's op seconds, the trainer's wait for rollouts,
    padding and prefill shares; the queue of iterations ahead where the async pipeline is on;
    their medians in the summary, whose closing lines show them."""
    from flexmarl_core.driver.console import summary_lines

    state, overrides = runs[mode]
    assert state.is_completed(), state.message
    out = state.result()
    cfg = load_config(TINY, overrides)
    metrics = Path(cfg.resolved_run_dir()) / "metrics"
    rows = [json.loads(x) for x in (metrics / "iterations.jsonl").read_text().splitlines()]
    ops = [json.loads(x) for x in (metrics / "ops.jsonl").read_text().splitlines()]
    agents = MEG.from_config(cfg.team).trainable_agents
    assert len(rows) == ITERATIONS
    for r in rows:
        it = r["iteration"]
        for a in agents:
            mine = {kind: [o for o in ops if (o["iteration"], o["kind"], o["agent"]) == (it, kind, a)]
                    for kind in ("train", "step", "sync")}
            for o in mine["train"]:  # measured inside the op: a part of its seconds
                assert 0 < o[f"agent/{a}/train/fwd_bwd_s"] <= o["t_end"] - o["t_start"], o
            assert r[f"agent/{a}/train/fwd_bwd_s"] == pytest.approx(sum(o[f"agent/{a}/train/fwd_bwd_s"] for o in mine["train"]))
            assert r[f"agent/{a}/train/step_s"] == pytest.approx(sum(o["t_end"] - o["t_start"] for o in mine["step"]))
            assert r[f"agent/{a}/sync/weight_sync_s"] > 0 and len(mine["sync"]) == 1
            assert r[f"agent/{a}/train/rollout_wait_s"] >= 0
            for share in ("train/padding_share", "train/shared_share", "rollout/prefill_share"):
                assert 0 <= r[f"agent/{a}/{share}"] <= 1, (a, share)
            assert r[f"agent/{a}/rollout/prefill_share"] > 0  # the HF engine prefills every prompt
        assert r["pipeline/rollout_wait_s"] == pytest.approx(sum(r[f"agent/{a}/train/rollout_wait_s"] for a in agents))
        if mode == "codesign":  # async, on-policy: no rollout starts before its iteration trains
            assert (r["pipeline/queue_depth"], r["pipeline/queue_bound"]) == (0, 0)
        else:
            assert "pipeline/queue_depth" not in r
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(metrics / "tensorboard"))
    board.Reload()
    for key in ("agent/solver/train/fwd_bwd_s", "agent/solver/rollout/prefill_share", "pipeline/rollout_wait_s"):
        assert [e.step for e in board.Scalars(key)] == list(range(ITERATIONS)), key
    block = out["summary"]["where_a_step_goes"]
    for a in agents:
        for f in ("train/fwd_bwd_s", "train/step_s", "sync/weight_sync_s", "train/padding_share",
                  "rollout/prefill_share"):
            key = f"agent/{a}/{f}"
            assert min(r[key] for r in rows) <= block[key] <= max(r[key] for r in rows)
    lines = summary_lines(out["summary"])
    at = lines.index("where a step goes (medians over iterations):")
    assert all(any(x.startswith(f"  {a}: fwd+bwd ") for x in lines[at:]) for a in agents), lines
    assert any(x.startswith("  pipeline: trainers waited") for x in lines[at:]), lines


def test_async_codesign_equals_sync(runs):
    """Same seed: the co-design run (async, balanced, on-demand swaps) produced exactly the
    synchronous run's samples, and the same weights (rtol 1e-4) after 3 iterations."""
    import torch

    dirs = {}
    for mode, (state, overrides) in runs.items():
        assert state.is_completed(), state.message
        dirs[mode] = load_config(TINY, overrides)
    cfg = dirs["sync"]
    meg = MEG.from_config(cfg.team)
    cols = ["sample_id", "policy_version", "prompt_ids", "response_ids", "reward", "consumed_step"]
    stores = {m: MEGStore(c.resolved_store_uri()) for m, c in dirs.items()}
    for it in range(ITERATIONS):
        for agent in meg.agent_names:
            a, b = (stores[m].read_samples(agent, it).select(cols).sort_by("sample_id") for m in ("sync", "codesign"))
            assert a.num_rows == b.num_rows > 0
            for c in cols:
                if c == "reward":
                    assert a.column(c).to_pylist() == pytest.approx(b.column(c).to_pylist(), rel=1e-6)
                else:
                    assert a.column(c).to_pylist() == b.column(c).to_pylist(), (it, agent, c)
    for agent in meg.trainable_agents:
        wa, wb = (load_file(str(weights_path(Path(c.resolved_run_dir()), agent, ITERATIONS))) for c in dirs.values())
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=f"{agent}.{k}")


def test_missing_tag_fails_fast_with_clear_error(prefect_api, dask_cluster, tmp_path):
    """The shared cluster's workers carry `rollout` and `train`; an agent pinned to a dedicated
    tag nobody has must fail at once, naming the tag, not hang."""
    overrides = [f"run_dir={tmp_path}/run", f"cluster.address={dask_cluster}",
                 "train.iterations=1"]
    from flexmarl_core.control import OrchestratorError, Router
    from flexmarl_core.ops import Op

    # A worker set with no `rollout` tag at all: route() must refuse before submitting.
    t0 = time.time()
    router = Router(load_balancing=True)
    with pytest.raises(OrchestratorError, match="rollout:solver"):
        router.route(Op(0, "rollout", "solver", 0, 0), {"tcp://x": {"train": 1}})
    # And Dask itself gives up on a task whose resource no worker has: the cluster runs with
    # flexmarl's no-workers timeout (15 s); the scheduler rereads it every 250 ms, so the
    # giving-up is watched under 1 s and the product's value put back.
    import distributed
    from dask.utils import parse_timedelta

    from flexmarl_core.cluster import NO_WORKERS_TIMEOUT
    with distributed.Client(dask_cluster) as client:
        assert client.run_on_scheduler(_no_workers_timeout) == parse_timedelta(NO_WORKERS_TIMEOUT)
        client.run_on_scheduler(_no_workers_timeout, 1.0)
        try:
            fut = client.submit(sum, [1, 2], resources={"agent:nobody": 1}, pure=False)
            with pytest.raises(Exception, match="(?i)valid worker|NoValidWorker"):
                fut.result(timeout=120)
        finally:
            client.run_on_scheduler(_no_workers_timeout, parse_timedelta(NO_WORKERS_TIMEOUT))
    assert time.time() - t0 < 120
    del overrides


def _no_workers_timeout(set_to: float | None = None, dask_scheduler=None) -> float:  # noqa: ANN001
    if set_to is not None:
        dask_scheduler.no_workers_timeout = set_to
    return dask_scheduler.no_workers_timeout


def _worker_prefect_settings() -> tuple[str | None, str | None]:
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL

    return PREFECT_API_SSL_CERT_FILE.value(), PREFECT_API_URL.value()


def test_lean_workers_report_with_their_own_settings(runs, prefect_api, dask_cluster):
    """Lean mode sends task runs no settings, so workers must use their own: the executor's
    worker plugin sets their env (the shared cluster started without it) and rebuilds Prefect's
    settings, which the worker built when it imported Prefect. Without it every task run paid a
    full CA-bundle SSL context (~0.1 CPU-s here)."""
    import distributed

    from tasks.lean import worker_env

    want = worker_env(prefect_api)
    with distributed.Client(dask_cluster) as client:
        got = client.run(_worker_prefect_settings)
    assert got and all(v == (want["PREFECT_API_SSL_CERT_FILE"], prefect_api) for v in got.values()), got


def _malloc_trim_env() -> str | None:
    import os

    return os.environ.get("MALLOC_TRIM_THRESHOLD_")


def test_workers_keep_glibc_adaptive_malloc(dask_cluster):
    """Dask's nannies would export MALLOC_TRIM_THRESHOLD_=65536, which made every stage 2-3x
    slower (fresh mmaps for every tensor); our workers keep whatever the caller had."""
    import distributed

    from tests.conftest import CALLER_MALLOC_TRIM

    with distributed.Client(dask_cluster) as client:
        got = client.run(_malloc_trim_env)
    assert len(got) == 2 and all(v == CALLER_MALLOC_TRIM for v in got.values()), got
