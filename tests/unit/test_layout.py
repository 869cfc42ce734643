"""`cluster.workers: auto` / `cluster.torch_threads: auto` (config/layout.py): the layout follows
the team's width and the machine's cores, every agent has an inference instance, and the
resolved layout is what the run folder keeps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flexmarl_core.config import ConfigError, ExperimentConfig, load_config
from flexmarl_core.config.layout import GIB, choose, line, machine_cores, resolve, width

REPO = Path(__file__).resolve().parents[2]
TEAM = ["planner", "solver", "verifier"]


def rollout_tags(workers: list[dict]) -> list[list[str]]:
    return [sorted(k.removeprefix("rollout:") for k in w["resources"] if k.startswith("rollout:")) for w in workers]


@pytest.mark.parametrize(("agents", "serial", "k", "want"), [
    (1, False, 0, 1), (1, False, 1, 2), (3, False, 0, 3), (3, False, 2, 6), (3, True, 0, 1), (3, True, 1, 2)])
def test_width_is_the_ops_that_can_run_at_once(agents, serial, k, want):
    assert width(agents, serial=serial, max_staleness=k) == want


@pytest.mark.parametrize(("agents", "k", "cores", "n", "threads"), [
    (["solver"], 0, 2, 1, 2),     # one op at a time: every core inside it
    (["solver"], 0, 16, 1, 16),
    (["solver"], 1, 2, 2, 1),     # rollout beside training: a core each
    (["solver"], 1, 1, 1, 1),     # no room to overlap on one core
    (TEAM, 0, 2, 2, 1),
    (TEAM, 0, 8, 3, 2),
    (TEAM, 1, 8, 6, 1),
    (TEAM, 0, 1, 1, 1),
])
def test_workers_times_threads_never_exceed_the_cores_and_use_them(agents, k, cores, n, threads):
    workers, t, _ = choose(agents, serial=False, max_staleness=k, cores=cores, memory=64 * GIB)
    assert (len(workers), t) == (n, threads)
    assert len(workers) * t <= cores and cores - len(workers) * t < len(workers)  # no core left a whole worker could use
    assert all(w["resources"]["train"] == 1 for w in workers)
    # every agent rolls out somewhere, and every worker serves someone
    assert set().union(*map(set, rollout_tags(workers))) == set(agents) and all(rollout_tags(workers))


def test_agents_take_workers_round_robin_in_team_order():
    workers, _, _ = choose(TEAM, serial=False, max_staleness=0, cores=2, memory=64 * GIB)
    # neighbours in the graph (which overlap under dependency parallelism) on different workers
    assert rollout_tags(workers) == [["planner", "verifier"], ["solver"]]
    workers, _, _ = choose(["solver"], serial=False, max_staleness=1, cores=2, memory=64 * GIB)
    assert rollout_tags(workers) == [["solver"], ["solver"]]


def test_memory_limits_share_the_machine():
    workers, _, _ = choose(TEAM, serial=False, max_staleness=0, cores=8, memory=8 * GIB)
    assert [w["memory_limit"] for w in workers] == ["2.13GiB"] * 3  # 0.8 x 8 GiB / 3
    workers, _, _ = choose(TEAM, serial=False, max_staleness=0, cores=8, memory=256 * GIB)
    assert {w["memory_limit"] for w in workers} == {"6.00GiB"}


def test_fixed_threads_or_fixed_workers_choose_the_other():
    workers, t, _ = choose(TEAM, serial=False, max_staleness=0, cores=8, memory=64 * GIB, threads=4)
    assert (len(workers), t) == (2, 4)
    data = {"team": {"agents": [{"name": "a"}]}, "cluster": {
        "workers": [{"name": "x", "nthreads": 2}, {"name": "y"}], "torch_threads": "auto"}}
    out = resolve(data, cores=12)
    assert out["cluster"]["torch_threads"] == 4 and out["cluster"]["workers"] == data["cluster"]["workers"]
    assert "auto torch threads" in out["cluster"]["layout"]


def test_a_config_with_auto_loads_resolved_and_its_saved_copy_keeps_the_layout(tmp_path):
    cfg = load_config(str(REPO / "configs" / "default.yaml"))
    cores = len(cfg.cluster.workers) * cfg.cluster.torch_threads
    assert cfg.cluster.layout and cfg.cluster.layout.startswith(f"{len(cfg.cluster.workers)} worker")
    assert "3 agents at once" in cfg.cluster.layout
    assert cores >= 1 and all(isinstance(w.resources, dict) for w in cfg.cluster.workers)
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    again = ExperimentConfig.model_validate(yaml.safe_load(saved.read_text()))
    assert again.cluster == cfg.cluster  # a resume elsewhere keeps the layout it started with


def test_staleness_turns_on_overlap_in_the_layout():
    cfg = load_config(str(REPO / "configs" / "overhead.yaml"), [
        "codesign.max_staleness=1", "team.agents.solver.algorithm.policy_loss=decoupled_ppo"])
    assert "rolling out beside its training (max_staleness 1)" in cfg.cluster.layout
    on_policy = load_config(str(REPO / "configs" / "overhead.yaml"))
    assert "one agent, on-policy" in on_policy.cluster.layout
    # more workers with overlap, unless the machine has a single core
    assert len(cfg.cluster.workers) == min(2, len(on_policy.cluster.workers) * on_policy.cluster.torch_threads)


def test_a_bad_value_names_the_field():
    with pytest.raises(ConfigError, match="cluster.workers"):
        load_config(str(REPO / "configs" / "overhead.yaml"), ["cluster.workers=many"])


def test_the_runs_first_line_says_the_layout_and_why():
    cfg = load_config(str(REPO / "configs" / "overhead.yaml"))
    assert line(cfg.cluster) == f"layout: {cfg.cluster.layout}"
    hand = load_config(str(REPO / "configs" / "tiny.yaml"))
    assert line(hand.cluster, cores=2) == ("layout: 2 workers x 1 torch thread on 2 cores "
                                           "(set in cluster.workers and cluster.torch_threads)")
    remote = load_config(str(REPO / "configs" / "tiny.yaml"), ["cluster.address=tls://10.0.0.1:8786"])
    assert line(remote.cluster) is None


def test_flexmarl_cores_sets_the_cores_the_layout_uses(monkeypatch):
    monkeypatch.setenv("FLEXMARL_CORES", "8")
    assert machine_cores() == 8
    cfg = load_config(str(REPO / "configs" / "default.yaml"))
    assert (len(cfg.cluster.workers), cfg.cluster.torch_threads) == (3, 2)
    assert cfg.cluster.layout.startswith("3 workers x 2 torch threads on 8 cores")
    monkeypatch.setenv("FLEXMARL_CORES", "two")
    with pytest.raises(ValueError, match="FLEXMARL_CORES='two'"):
        machine_cores()


def test_a_core_kept_busy_at_this_priority_is_left_out(monkeypatch):
    """Without FLEXMARL_CORES the auto layout leaves out the cores other work at this priority
    keeps busy (at least one core stays), and says so in the layout line."""
    from flexmarl_core.config import layout

    monkeypatch.delenv("FLEXMARL_CORES", raising=False)
    monkeypatch.setattr(layout, "BUSY_REUSE_S", -1.0)  # a new sample on every call
    mine = len(os.sched_getaffinity(0))
    monkeypatch.setattr(layout, "busy_elsewhere", lambda: 1.0)
    assert layout.free_cores() == (max(1, mine - 1), f"; 1 of {mine} cores busy with other work"
                                   if mine > 1 else "")
    monkeypatch.setattr(layout, "busy_elsewhere", lambda: 64.0)
    assert layout.free_cores()[0] == 1
    if mine > 1:
        cfg = load_config(str(REPO / "configs" / "overhead.yaml"))
        assert cfg.cluster.torch_threads == 1 and "busy with other work" in cfg.cluster.layout
    monkeypatch.setattr(layout, "busy_elsewhere", lambda: 0.3)  # a process that comes and goes
    assert layout.free_cores() == (mine, "")


def test_threads_in_this_process_leave_out_busy_cores_even_where_flexmarl_cores_is_set(monkeypatch):
    """`FLEXMARL_CORES` fixes a layout (the tests set it), but torch threads in this process
    (SFT) still leave out a busy core: the first run's SFT beside a spinning core took 13-15 s a
    step on two threads under FLEXMARL_CORES=2, 0.5 s on one."""
    import torch

    from flexmarl_core.config import layout

    monkeypatch.setenv("FLEXMARL_CORES", "2")
    monkeypatch.setattr(layout, "BUSY_REUSE_S", -1.0)
    monkeypatch.setattr(layout, "busy_elsewhere", lambda: 1.0)
    assert layout.free_cores() == (2, "")  # the layout stays fixed
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        said: list[str] = []
        with layout.torch_threads_on_free_cores(said.append):
            inside = torch.get_num_threads()
        assert (inside, said) == (1, ["1 torch thread; 1 of 2 cores busy with other work"])
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(layout, "busy_elsewhere", lambda: 0.0)  # quiet: torch keeps its two
        with layout.torch_threads_on_free_cores(said.append):
            assert torch.get_num_threads() == 2
        assert len(said) == 1
    finally:
        torch.set_num_threads(before)


def test_a_command_that_loads_its_config_twice_samples_the_machine_once(monkeypatch):
    from flexmarl_core.config import layout

    monkeypatch.delenv("FLEXMARL_CORES", raising=False)
    monkeypatch.setattr(layout, "_busy_sample", None)
    samples = []
    monkeypatch.setattr(layout, "busy_elsewhere", lambda: samples.append(1) or 0.0)
    assert layout.free_cores() == layout.free_cores()
    assert len(samples) == (1 if len(os.sched_getaffinity(0)) > 1 else 0)  # one core: nothing to sample
    layout.look_again()  # a caller that changed the load since (a bench's background) looks again
    layout.free_cores()
    assert len(samples) == (2 if len(os.sched_getaffinity(0)) > 1 else 0)


def test_busy_cores_are_counted_from_processes_this_run_shares_cores_with():
    """A process at this process's nice counts; one at a higher nice in this session does not
    (it yields its core). Where autogroup scheduling is on, a process in a session of its own
    counts by its session's nice: at nice 0, whatever its own nice; a session niced to 10 (as
    the Prefect server flexmarl starts) does not."""
    from flexmarl.prefect_api import _nice_session
    from flexmarl_core.config.layout import _autogroup, _cpu_ticks, _shares_with_me

    def _shares_with_me_(pid: int) -> bool:  # as `busy_elsewhere` asks it
        return _shares_with_me(pid, _cpu_ticks()[pid][1], _autogroup("self"), os.getpriority(os.PRIO_PROCESS, 0))

    spin = [sys.executable, "-c", "while True: pass"]
    same = subprocess.Popen(spin)
    procs = [same]
    try:
        assert _shares_with_me_(same.pid)
        mine = _autogroup("self")
        if os.getpriority(os.PRIO_PROCESS, 0) < 19:
            # niced before it runs (Popen returns once the child has exec'd)
            lower = subprocess.Popen(spin, preexec_fn=lambda: os.nice(1))
            procs.append(lower)
            assert not _shares_with_me_(lower.pid)
        if mine is not None and mine[1] < 10:
            apart = subprocess.Popen(spin, preexec_fn=lambda: os.nice(1), start_new_session=True)
            quiet = subprocess.Popen(spin, preexec_fn=lambda: _nice_session(10), start_new_session=True)
            procs += [apart, quiet]
            assert _autogroup(apart.pid)[0] != mine[0]
            assert _shares_with_me_(apart.pid) == (_autogroup(apart.pid)[1] <= mine[1])
            if _autogroup(quiet.pid)[1] == 10:  # an unprivileged write may be refused (at most one per 0.1 s)
                assert not _shares_with_me_(quiet.pid)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_runs_own_processes_are_not_busy_elsewhere():
    """A launch's cluster starts while the config loads again in the flow: its workers (children
    of the forkserver, a child of the launch) are this run's own processes, not other work."""
    from flexmarl_core.config.layout import _cpu_ticks, descendants

    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        ours = descendants(os.getpid(), _cpu_ticks())
        assert {child.pid, grandchild} <= ours
        assert 1 not in ours and os.getppid() not in ours
    finally:
        os.kill(grandchild, 9)
        child.kill()
        child.wait()
