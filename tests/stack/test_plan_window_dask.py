"""The scheduler lets go of flexmarl's finished task groups (`flexmarl_core/cluster/executor.py`
`_drop_forgotten_groups`): on a real Dask cluster, a long run's ops leave no task group behind
(the rest of the long-run memory checks, on the in-process executor: tests/unit/test_plan_window.py)."""

from __future__ import annotations

import time

from flexmarl_core.ops import Op


def _one(x: int) -> int:
    return x


def test_the_scheduler_lets_go_of_our_finished_task_groups(dask_cluster):
    """Dask keeps every task group in its span and computation even after forgetting it, and
    ops running one at a time make a new group each: one kept per op. `forget` drops ours
    (and leaves anyone else's)."""
    import distributed

    from flexmarl_core.cluster.executor import _drop_forgotten_groups, dask_key

    with distributed.Client(dask_cluster, set_as_default=False) as client:
        def held() -> list[str]:
            def names(dask_scheduler):
                spans = dask_scheduler.extensions["spans"].spans.values()
                return sorted(tg.name for holder in [*spans, *dask_scheduler.computations] for tg in holder.groups)
            return client.run_on_scheduler(names)

        def forgotten(key: str) -> bool:
            return client.run_on_scheduler(lambda dask_scheduler: key not in dask_scheduler.tasks)

        for i in range(3):  # one at a time: each group is made, emptied and forgotten
            for key in (dask_key(Op(i, "step", "solver")), f"other-thing-{i:08x}"):
                f = client.submit(_one, i, key=key, pure=False)
                assert f.result() == i
                del f
                deadline = time.monotonic() + 60
                while not forgotten(key) and time.monotonic() < deadline:
                    time.sleep(0.05)
        before = held()
        # three groups each, held by the default span and by the computation (or two)
        assert before.count("step[solver]") >= 3 and before.count("other-thing") >= 3
        assert client.run_on_scheduler(_drop_forgotten_groups) >= before.count("step[solver]")  # and earlier tests'
        after = held()
        assert "step[solver]" not in after and after.count("other-thing") == before.count("other-thing")
