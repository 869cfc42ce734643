"""The code team's sandbox inside real Dask worker processes: hostile programs score 0 and the
workers live. (The code team's run, its sandboxed rewards and co-design equal to sync, is in
tests/unit/test_codesign_teams.py.)"""

from __future__ import annotations

import time
from pathlib import Path

from flexmarl_core.cluster import workers_info
from flexmarl_core.config import load_config
from flexmarl_core.workloads import make_workload

REPO = Path(__file__).resolve().parents[2]
CODE = str(REPO / "configs" / "code_team.yaml")


HOSTILE_CODERS = [
    "__import__('os').fork()",
    "__import__('time').sleep(600)",
    "[bytearray(1 << 26) for _ in range(100)]",
    "__import__('os').kill(__import__('os').getppid(), 9)",  # the parent is the Dask worker
    "__import__('os')._exit(0)",
    "[0 for _ in iter(int, 1)]",
]


def test_hostile_programs_in_the_workers_score_zero_and_the_workers_live(dask_cluster):
    """The reward stage's sandbox inside real Dask workers: every hostile program scores 0
    within its limits, no worker dies, and the same workers then judge a right program."""
    import distributed

    cfg = load_config(CODE, [])
    workload = make_workload(cfg.workload, cfg.team)
    problem = workload.problems("train", 1, seed=0)[0]
    # The right program is judged with room on the wall clock (a loaded machine gives a
    # sandboxed child a fraction of a core); the hostile ones keep the config's limits.
    roomy_cfg = load_config(CODE, ["workload.params.wall_s=30"])
    roomy = make_workload(roomy_cfg.workload, roomy_cfg.team)

    def reward(code: str, judge=workload) -> dict[str, float]:
        return judge.reward(problem, {"coder": code, "tester": ""})

    with distributed.Client(dask_cluster) as client:
        before = set(workers_info(client))
        t0 = time.monotonic()
        results = client.gather(client.map(reward, HOSTILE_CODERS, pure=False))
        # Each program ends at its limits (wall_s 3 here): far inside the 600 s one would sleep.
        assert time.monotonic() - t0 < 300
        assert [r["coder"] for r in results] == [0.0] * len(HOSTILE_CODERS)
        assert set(workers_info(client)) == before
        assert client.submit(reward, problem.answer, roomy, pure=False).result()["coder"] == 1.0
