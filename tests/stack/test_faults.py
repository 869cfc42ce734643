"""Faults on the real stack: a Dask worker process killed during a rollout and during a
training micro-step, an op that hangs (cancelled past its deadline, its worker restarted), a
stage that raises once (Prefect's task retry), a stage that fails for good (Prefect's flow-run
retry resumes the run), and the whole training process killed (kill -9) and resumed. After
each, the store holds every sample exactly once and the final weights equal an uninterrupted
run's; a killed run leaves no flow or task run open once the audit or the resume has seen it.
The uninterrupted run's Prefect artifacts are checked here too."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmarl_core.config import load_config
from flexmarl_core.meg import MEG
from flexmarl_core.runfiles.location import RunLocation, shown
from flexmarl_core.runtime.worker import trainer_state_path, weights_path
from flexmarl_core.stages import faults_dir
from tests._holds import Holds
from tests._runs import (
    COMMON,
    ITERATIONS,
    REPO,
    TINY,
    assert_exactly_once,
    assert_same_samples,
    assert_same_weights,
    flow,
    flow_run,
    kill_group_when,
    open_runs_under,
    ops_log,
    plant_fault,
    task_runs,
)


@pytest.mark.parametrize("victim", ["rollout[solver] it=1 mb=0", "train[solver] it=1 mb=1"])
def test_worker_killed_mid_stage_run_completes_exactly_once(baseline, dask_cluster, tmp_path, victim):
    run_dir = tmp_path / "run"
    marker = plant_fault(run_dir, "kill", victim)
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *COMMON]
    state = flow(overrides)
    assert state.is_completed(), state.message
    assert not marker.exists(), "the fault never fired"
    cfg = load_config(TINY, overrides)
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    # A killed op pinned to its worker came back as soon as the worker left (the pin names an
    # address the restarted worker no longer has), not after Dask's 15 s no-workers timeout.
    # One routed by tags alone Dask runs again itself, with no resubmit.
    decisions = [json.loads(x) for x in (run_dir / "metrics" / "decisions.jsonl").read_text().splitlines()]
    back = [d for d in decisions if d["decision"] == "resubmit"]
    assert all(d["error"].startswith("WorkerLeftError: worker ") for d in back), back
    ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines()]
    if victim.startswith("train"):
        # mb=0's gradients died with the worker. Either the step accumulated them again from the
        # store, or Dask reran mb=0 itself (its result was held on the dead worker, and ops are
        # plain Dask tasks now); the same weights above show they reached the update once.
        step = next(o for o in ops if o["op"] == "step[solver] it=1")
        assert step["agent/solver/recomputed_mbs"] in (0.0, 1.0) or step.get("skipped"), step
        assert sum(o["op"] == "step[solver] it=1" for o in ops) == 1, "the step ran twice"


def test_a_result_whose_worker_left_before_it_was_fetched_comes_back_as_lost(dask_cluster, tmp_path):
    """An op finished on a worker that then left, before the orchestrator fetched its result:
    the result lived only there, and Dask would run the op again where it is pinned (an address
    no worker has) and hold the fetch until its no-workers timeout, then fail it as
    `NoValidWorkerError`. The executor gives it back as lost, so the orchestrator routes it
    again at once."""
    import distributed

    from flexmarl_core.cluster import DaskExecutor, WorkerLeftError, workers_info
    from flexmarl_core.ops import Route

    with distributed.Client(dask_cluster) as client:
        ex = DaskExecutor(client, str(tmp_path))
        addr = next(a for a, w in workers_info(client).items() if w["name"] == "w0")
        handle = ex.track(Route({}, worker=addr), (), client.submit(os.getpid, workers=[addr], pure=False))
        assert ex.wait_any([handle], timeout=60) == [handle]
        client.restart_workers([addr], timeout=120)  # w0 comes back at a new address; the result is gone
        assert addr not in workers_info(client)
        with pytest.raises(WorkerLeftError, match=f"worker {addr} left the cluster"):
            ex.result(handle)


def _wait_for(event: str) -> None:
    import distributed

    distributed.Event(event).wait(120)


def _first(x: object, *_: object) -> object:
    return x


def test_an_op_chained_on_a_result_whose_worker_left_comes_back_as_lost(dask_cluster, tmp_path):
    """B is chained on A (pinned to w0, done, its result fetched) and on C (held on w1). w0
    leaves before B ran: Dask would run A again where it is pinned, an address no worker has,
    and B would wait out the no-workers timeout. The executor gives B back as lost at once
    (its inputs are in the store: the orchestrator runs it again)."""
    import distributed

    from flexmarl_core.cluster import DaskExecutor, WorkerLeftError, workers_info
    from flexmarl_core.ops import Route

    with distributed.Client(dask_cluster) as client:
        ex = DaskExecutor(client, str(tmp_path))
        by_name = {w["name"]: a for a, w in workers_info(client).items()}
        w0, w1 = by_name["w0"], by_name["w1"]
        go = distributed.Event(f"release-{tmp_path.name}")
        a = ex.track(Route({}, worker=w0), (), client.submit(os.getpid, workers=[w0], pure=False))
        c = ex.track(Route({}, worker=w1), (), client.submit(_wait_for, go.name, workers=[w1], pure=False))
        b = ex.track(Route({}, worker=w1), (a, c), client.submit(_first, a, c, workers=[w1], pure=False))
        assert ex.wait_any([a], timeout=60) == [a]
        ex.result(a)
        client.restart_workers([w0], timeout=120)  # a's result is gone with it
        try:
            assert ex.wait_any([b, c], timeout=60) == [b]
            with pytest.raises(WorkerLeftError, match=f"worker {w0} left the cluster holding a result"):
                ex.result(b)
        finally:
            go.set()
        assert ex.wait_any([c], timeout=60) == [c]


def test_hung_op_is_cancelled_its_worker_restarted_and_the_op_rerun(baseline, dask_cluster, tmp_path):
    """`hang@`: a rollout that never returns. Past its deadline (`cluster.deadlines`: 10 s at
    least, or 10 times the solver's measured rollout seconds) the orchestrator cancels it,
    restarts the worker running it and submits it again; the decision log names the op, the
    worker and the deadline, and the run ends as the undisturbed one."""
    victim = "rollout[solver] it=1 mb=0"
    run_dir = tmp_path / "run"
    marker = plant_fault(run_dir, "hang", victim, "300")  # not cancelled: it fails, late
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *COMMON,
                 "cluster.deadlines.floor_s=10"]
    state = flow(overrides)
    assert state.is_completed(), state.message
    assert not marker.exists(), "the fault never fired"
    cfg = load_config(TINY, overrides)
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    assert_same_samples(baseline, cfg)
    decisions = [json.loads(x) for x in (run_dir / "metrics" / "decisions.jsonl").read_text().splitlines()]
    hung = [d for d in decisions if d["decision"] == "hung_op" and victim in d["op"].split(" + ")]  # fused: all its ops
    assert len(hung) == 1, decisions
    assert hung[0]["worker"] in ("w0", "w1") and hung[0]["deadline_s"] >= 10, hung
    assert hung[0]["waited_s"] >= hung[0]["deadline_s"]
    assert [o["op"] for o in ops_log(run_dir)].count(victim) == 1


def test_gradient_helpers_on_dask_train_the_same_weights(baseline, dask_cluster, tmp_path):
    """`codesign.gradient_helpers` on the real cluster: both of the solver's train ops of
    iteration 0 are held (`hold@`) until they run at the same time, which only a gradient
    helper allows (an agent's trainer runs one op at a time); the test then releases them.
    Every helper's gradient reaches its step, and the run equals the uninterrupted one without
    helpers. With `async_pipeline` off, training waits for every reward of the iteration, so
    nothing a helper needs can queue behind the held op."""
    run_dir = tmp_path / "run"
    victims = [f"train[solver] it=0 mb={mb}" for mb in (0, 1)]
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *COMMON,
                 "codesign.gradient_helpers=true", "codesign.async_pipeline=false"]
    with Holds(run_dir, victims, lambda held: held == set(victims)) as holds:
        state = flow(overrides)
    assert state.is_completed(), state.message
    assert holds.seen == set(victims), "the solver's two train ops never ran at the same time"
    assert holds.fired()
    cfg = load_config(TINY, overrides)
    decisions = [json.loads(line) for line in (run_dir / "metrics" / "decisions.jsonl").read_text().splitlines()]
    helped = [d for d in decisions if d["decision"] == "gradient_helper"]
    assert any(d["agent"] == "solver" and d["iteration"] == 0 for d in helped), helped
    ops = [json.loads(line) for line in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines()]
    steps = [r for r in ops if r["kind"] == "step"]
    assert sum(r[f"agent/{r['agent']}/helper_mbs"] for r in steps) == len(helped)
    # Each helper op ran away from the worker that stepped its agent (the trainer's).
    where = {(r["kind"], r["agent"], r["iteration"], r["mb"]): r["worker"] for r in ops}
    for d in helped:
        assert where[("train", d["agent"], d["iteration"], d["mb"])] != where[("step", d["agent"], d["iteration"], -1)]
    assert_exactly_once(cfg)
    assert_same_samples(baseline, cfg)
    assert_same_weights(baseline, cfg)


def test_hold_marker_holds_an_op_until_it_is_released(tmp_path):
    """`hold@<op>`: the op waits (saying so with `held@<op>`) until `release@<op>` appears,
    then goes on with every marker gone; one not released in time raises `InjectedFault`."""
    import threading

    from flexmarl_core.stages.faults import InjectedFault, fault_point, held_ops, release

    run_dir = str(tmp_path / "run")
    op = "train[solver] it=0 mb=1"
    marker = plant_fault(Path(run_dir), "hold", op)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (fault_point(run_dir, op), done.set()))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while op not in held_ops(run_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held_ops(run_dir) == {op} and not done.is_set()
        fault_point(run_dir, "train[solver] it=0 mb=0")  # other ops pass by
        release(run_dir, op)
        assert done.wait(60), "the held op did not go on once released"
    finally:
        if not done.is_set():
            release(run_dir, op)
        worker.join()
    assert not list(marker.parent.iterdir()) and held_ops(run_dir) == set()
    fault_point(run_dir, op)  # consumed: a rerun goes through
    marker.write_text("0.05")
    with pytest.raises(InjectedFault, match=r"hold@.*not released within 0.05 s"):
        fault_point(run_dir, op)
    assert not list(marker.parent.iterdir())
    marker.write_text("soon")
    with pytest.raises(ValueError, match="hold@train.*'soon'.*number of seconds"):
        fault_point(run_dir, op)


def test_stage_raising_once_is_retried_by_prefect(baseline, dask_cluster, tmp_path):
    """`raise@`: the stage raises once; the task's own retry (retries=2) reruns it in place."""
    victim = "rollout[solver] it=1 mb=0"
    run_dir = tmp_path / "run"
    marker = plant_fault(run_dir, "raise", victim)
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *COMMON]
    state = flow(overrides)
    assert state.is_completed(), state.message
    assert not marker.exists(), "the fault never fired"
    cfg = load_config(TINY, overrides)
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    assert_same_samples(baseline, cfg)
    # The orchestrator saw one op that succeeded: the retry happened inside the task run.
    assert [o["op"] for o in ops_log(run_dir)].count(victim) == 1
    # The server records task runs from events in batches: poll briefly for the retried one.
    deadline = time.time() + 30
    while True:
        runs = [r for r in asyncio.run(task_runs(state.state_details.flow_run_id)) if r.name == victim]
        if (runs and runs[0].state.is_completed() and runs[0].run_count >= 2) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(runs) == 1, [r.name for r in runs]
    assert runs[0].state.is_completed() and runs[0].run_count == 2, (runs[0].state, runs[0].run_count)


def test_flow_run_retry_resumes_the_run(baseline, dask_cluster, tmp_path):
    """`fail@` with a count above the rollout task's retries fails the op, hence attempt 1 of the
    flow run; Prefect's flow retry (attempt 2) resumes from the op log instead of starting over."""
    from flows.train import train

    victim = "rollout[solver] it=1 mb=0"
    run_dir = tmp_path / "run"
    marker = plant_fault(run_dir, "fail", victim, "3")  # 1 try + 2 task retries, all fail
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", *COMMON]
    state = train.with_options(retries=1)(TINY, overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message
    assert not marker.exists(), "the fault never fired"
    fr, states = asyncio.run(flow_run(state.state_details.flow_run_id))
    assert fr.run_count == 2, fr.run_count
    # Attempt 1 ended when the flow run went back to a scheduled (AwaitingRetry) state.
    retried_at = min(s.timestamp for s in states if s.is_scheduled() and s.name == "AwaitingRetry").timestamp()
    ops = ops_log(run_dir)
    first = [o for o in ops if o["finished"] < retried_at]
    assert any(o["iteration"] == 0 for o in first), "attempt 1 completed no op: nothing to resume"
    assert victim not in {o["op"] for o in first}
    cfg = load_config(TINY, overrides)
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    assert_same_samples(baseline, cfg)
    # Completed ops were not rerun: each op once, except training of an iteration whose step
    # had not happened in attempt 1 (its gradients lived in memory; see completed_records).
    names = [o["op"] for o in ops]
    assert set(names) == {o["op"] for o in ops_log(baseline.resolved_run_dir())}
    stepped = {(o["agent"], o["iteration"]) for o in first if o["kind"] == "step"}
    repeated = [o for o in ops if names.count(o["op"]) > 1]
    assert all(o["kind"] == "train" and (o["agent"], o["iteration"]) not in stepped for o in repeated), \
        sorted({o["op"] for o in repeated})
    its = [json.loads(x)["iteration"] for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    assert its == list(range(ITERATIONS))
    # The iterations' nested flow runs: attempt 1's iteration 1 failed with the flow; attempt 2
    # made its own, Completed; every iteration has a Completed one, each holding only its ops.
    from tests.stack.test_iteration_runs import children_of

    _, kids, task_runs_of = children_of(state.state_details.flow_run_id, ITERATIONS + 1)
    by_name = {k.name: k for k in kids.values()}
    assert by_name[f"{cfg.name} it 1"].state.is_failed(), by_name[f"{cfg.name} it 1"].state
    assert by_name[f"{cfg.name} it 1 (flow run 2)"].state.is_completed()
    done = {int(k.name.split()[2]) for k in kids.values() if k.state.is_completed()}
    assert done == set(range(ITERATIONS)), sorted(by_name)
    for k in kids.values():
        it = int(k.name.split()[2])
        assert all(f" it={it}" in r.name for r in task_runs_of[k.id]), k.name


def test_run_artifacts(baseline_run, prefect_api):
    """The flow run publishes its iterations table, decisions table and markdown summary."""
    import httpx

    cfg, flow_run_id = baseline_run
    arts = httpx.post(f"{prefect_api}/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [str(flow_run_id)]}}}).json()
    by_key = {a["key"]: a for a in arts}
    assert set(by_key) >= {"arith-tiny-iterations", "arith-tiny-decisions", "arith-tiny-summary"}, sorted(by_key)
    agents = MEG.from_config(cfg.team).agent_names

    table = by_key["arith-tiny-iterations"]
    assert table["type"] == "table"
    rows = json.loads(table["data"])
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS))
    want = {"e2e_s", "tokens_per_s", "utilization", "accuracy", "balance_moves", "train_swaps",
            "swap_in_bytes", "swap_out_bytes", *(f"agent/{a}/reward" for a in agents)}
    assert all(want <= set(r) for r in rows), sorted(rows[0])
    assert all(r["tokens_per_s"] > 0 and 0 < r["utilization"] <= 1 for r in rows)

    decisions = by_key["arith-tiny-decisions"]
    assert decisions["type"] == "table"
    cols = json.loads(decisions["data"])
    assert {"t", "decision", "iteration", "agent", "worker", "from_agent", "to_agent", "loads",
            "cost_bytes", "swap"} <= set(cols), sorted(cols)
    logged = [json.loads(x) for x in (cfg.resolved_run_dir() / "metrics" / "decisions.jsonl").read_text().splitlines()]
    assert len(cols["decision"]) == len(logged) and sorted(cols["decision"]) == sorted(d["decision"] for d in logged)
    # tiny.yaml turns on-demand allocation on: a training slot per trainable agent and iteration.
    assert cols["decision"].count("train_slot") == len(agents) * ITERATIONS

    md = by_key["arith-tiny-summary"]
    assert md["type"] == "markdown"
    text = md["data"]
    # Where the run is, relative: never this machine's absolute path.
    assert f"store: `{shown(cfg.resolved_store_uri())}`" in text and f"run folder: `{shown(cfg.resolved_run_dir())}`" in text
    assert str(cfg.resolved_run_dir()) not in text
    chart = text.split("```text", 1)[1].split("```", 1)[0]
    assert "reward per agent" in chart and "tokens/s" in chart
    assert all(any(line.startswith(a) and any(c in line for c in "▁▂▃▄▅▆▇█") for line in chart.splitlines())
               for a in agents), chart
    assert sum(line.startswith("it ") and "│" in line for line in chart.splitlines()) == ITERATIONS, chart
    # Dict-valued figures render as sub-items, not as a Python repr.
    assert "- critical_path:\n  - " in text and "{'" not in text, text


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def hold_steps(run_dir: Path, iteration: int) -> Path:
    """`hold@` every trainable agent's step of `iteration` (none can end before the test
    kills the run); returns the markers' folder, which the test removes before resuming."""
    folder = Path(faults_dir(run_dir))
    folder.mkdir(parents=True)
    for agent in MEG.from_config(load_config(TINY).team).trainable_agents:
        (folder / f"hold@step[{agent}] it={iteration}").write_text("")
    return folder


def test_kill_9_training_process_then_resume(baseline, prefect_api, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    sets = [x for o in [f"run_dir={run_dir}", *COMMON] for x in ("--set", o)]
    # Kill in the middle of iteration 1: some of its training done, its steps held (not done).
    holds = hold_steps(run_dir, 1)
    log = run_dir / "metrics" / "ops.jsonl"
    kill_group_when(_cli("train", TINY, *sets, "--no-progress", env=env),
                    lambda: log.exists() and any(r["iteration"] == 1 and r["kind"] == "train" for r in ops_log(run_dir)))
    done_before = [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]
    assert not any(f"step[{a}] it=1" in done_before for a in ("planner", "solver", "verifier"))
    # The killed run's flow run stops showing Running once its dead lease is seen.
    killed = json.loads((run_dir / "run.lease").read_text())["flow_run"]
    # (the audit's main in this process: the command's own process is not the subject here)
    from flexmarl.cli import main

    main(["store", "audit", str(run_dir)])
    seen = capsys.readouterr()
    assert "stopped without ending" in seen.out, seen.out + seen.err
    run, _ = asyncio.run(flow_run(killed))
    assert run.state.is_crashed(), run.state
    # ... and so does everything under it: its iterations' flow runs, its held steps' task runs.
    assert open_runs_under(killed) == []
    shutil.rmtree(holds)  # the resumed run goes through
    resumed = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    cfg = load_config(run_dir / "config.yaml")
    assert_exactly_once(cfg)
    assert_same_weights(baseline, cfg)
    # Completed ops were not run again: each op appears once in the op log across both attempts,
    # except training of an iteration whose step had not happened (its gradients were lost).
    names = [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]
    repeated = {n for n in names if names.count(n) > 1}
    assert all(n.startswith("train[") and " it=1 " in n + " " for n in repeated), repeated
    iterations = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in iterations] == list(range(ITERATIONS))
    # The iteration the kill cut through leaves the downtime out of its time, and says so.
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    spans = [m for m in iterations if m.get("downtime_s")]
    assert [m["iteration"] for m in spans] == [1], [(m["iteration"], m.get("downtime_s")) for m in iterations]
    it1 = [r for r in rows if r["iteration"] == 1]
    raw = max(r["t_end"] for r in it1) - max(r["t_end"] for r in rows if r["iteration"] == 0)
    assert spans[0]["e2e_s"] == pytest.approx(raw - spans[0]["downtime_s"], rel=1e-6)


#: one worker, so trainer states and weight files stay in its memory between checkpoints
ONE_WORKER = "cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}]"
SCHEDULED = ["train.iterations=5", "train.checkpoint_every=2"]  # checkpoints v2, v4 and v5


def test_kill_9_between_checkpoints_then_resume_replays(prefect_api, dask_cluster, tmp_path):
    """`train.checkpoint_every=2` on one worker: killed in iteration 3 (state v3 only in the
    dead worker's memory, last checkpoint v2), the resumed run replays iteration 2's update from
    the store's samples and ends with the uninterrupted run's weights."""
    import shutil

    base = [f"run_dir={tmp_path}/baseline", f"cluster.address={dask_cluster}", *COMMON, *SCHEDULED]
    state = flow(base)
    assert state.is_completed(), state.message
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO)}
    sets = [x for o in [f"run_dir={run_dir}", *COMMON, *SCHEDULED, ONE_WORKER] for x in ("--set", o)]
    # Killed in iteration 3 once it trains: its steps (checkpoint v4) are held, not done.
    holds = hold_steps(run_dir, 3)
    log = run_dir / "metrics" / "ops.jsonl"
    kill_group_when(_cli("train", TINY, *sets, "--no-progress", env=env),
                    lambda: log.exists() and any(r["iteration"] == 3 and r["kind"] == "train" for r in ops_log(run_dir)))
    done_before = [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]
    agents = MEG.from_config(load_config(TINY).team).trainable_agents
    stepped = [a for a in agents if f"step[{a}] it=2" in done_before]
    assert stepped, "killed too early: no agent had stepped iteration 2"
    for a in stepped:  # its state v3 lived only in the killed worker
        assert trainer_state_path(run_dir, a, 2).exists() and not trainer_state_path(run_dir, a, 3).exists()
        assert not weights_path(run_dir, a, 3).exists()
    shutil.rmtree(holds)
    killed = json.loads((run_dir / "run.lease").read_text())["flow_run"]
    resumed = _cli("train", "--resume", str(run_dir), "--no-progress", env=env)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    # The resume ended what the killed attempt left open (its held steps' task runs were
    # Pending), and left nothing of its own open: no Running flow or task run anywhere.
    attempts = json.loads((run_dir / "prefect-runs.json").read_text())["attempts"]
    assert [a["flow_run"] for a in attempts][0] == killed and attempts[-1]["ended"] == "COMPLETED"
    run, _ = asyncio.run(flow_run(killed))
    assert run.state.is_crashed(), run.state
    assert open_runs_under(killed) == [] and open_runs_under(attempts[-1]["flow_run"]) == []
    cfg, want = load_config(run_dir / "config.yaml"), load_config(TINY, base)
    assert_exactly_once(cfg)
    for a in agents:
        wa = load_file(str(weights_path(want.resolved_run_dir(), a, 5)))
        wb = load_file(str(weights_path(run_dir, a, 5)))
        # float32 weights of magnitude ~0.1-1 after a replayed update: the same samples and
        # order give the same sums up to reassociation, far inside 1e-4.
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=f"{a}.{k}")
        assert RunLocation(run_dir).versions(f"trainers/{a}") == [5]  # retention: the newest
    names = [json.loads(x)["op"] for x in log.read_text().splitlines() if x.strip()]
    repeated = {n for n in names if names.count(n) > 1}
    assert all(n.startswith("train[") and " it=3 " in n + " " for n in repeated), repeated


def test_resume_refuses_a_changed_config(tmp_path):
    from flexmarl_core.driver import run

    cfg = load_config(TINY, [f"run_dir={tmp_path}/run", "train.iterations=1"])
    (tmp_path / "run").mkdir()
    with pytest.raises(run.ResumeError, match="no config.yaml"):
        run.check_resumable(cfg, tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text("name: other\n")
    with pytest.raises(run.ResumeError, match="config differs"):
        run.check_resumable(cfg, tmp_path / "run")
