"""flexmarl_core.analysis.bound: the floors of a schedule are lower bounds (a tiny graph worked by hand),
the greedy schedule respects them, and the trainer rule (an agent's train ops one at a time)
is part of the chain."""

from __future__ import annotations

from flexmarl_core.analysis import bound
from flexmarl_core.ops import Op


def _graph():
    # a -> b (a chain of 3 s), c independent (2 s); two train ops of one agent released by a,
    # then its step: the step starts no sooner than a + both trains run one after the other.
    a, b, c = Op(0, "rollout", "p", mb=0), Op(0, "rollout", "s", mb=0), Op(0, "rollout", "p", mb=1)
    t0, t1, st = Op(0, "train", "s", mb=0), Op(0, "train", "s", mb=1), Op(0, "step", "s")
    deps = {a: [], b: [a], c: [], t0: [a], t1: [a], st: [t0, t1]}
    d = {a: 1.0, b: 2.0, c: 2.0, t0: 1.5, t1: 1.5, st: 0.5}
    return deps, d


def test_chain_floor_counts_the_trainer_rule():
    deps, d = _graph()
    # a (1) then the two trains one at a time (3) then the step (0.5); ignoring the rule, 3.0.
    assert bound.chain_floor(deps, d) == 4.5


def test_list_schedule_is_at_least_every_floor_and_packs_this_graph():
    deps, d = _graph()
    work = sum(d.values())  # 8.5 s of work
    for w in (1, 2, 3):
        ls = bound.list_schedule(deps, d, w)
        assert ls >= max(work / w, bound.chain_floor(deps, d)) - 1e-9
    assert bound.list_schedule(deps, d, 1) == work  # one worker: never idle here
    # Two workers, greedy: a | c; at 1 b, t0 and t1 tie on remaining chain (2 s) and b goes
    # first; t0 at 2 on the other; t1 waits for t0 (3.5), the step ends at 5.5. Running t0 at 1
    # instead (c | a, t0, t1 and b, t1 at 2.5, step at 4) meets the floor of 4.5: the truth lies
    # between the two figures, as the module says.
    assert bound.list_schedule(deps, d, 2) == 5.5


def test_a_search_of_perturbed_priorities_finds_the_order_the_greedy_one_misses():
    deps, d = _graph()
    # The order above that meets the floor (t0 before b at 1) is one perturbation away.
    assert bound.best_list_schedule(deps, d, 2, trainer_serial=True) == 4.5
    # An explicit priority is obeyed: t0 above b at 1 is that order.
    a, b, c = Op(0, "rollout", "p", mb=0), Op(0, "rollout", "s", mb=0), Op(0, "rollout", "p", mb=1)
    t0, t1, st = Op(0, "train", "s", mb=0), Op(0, "train", "s", mb=1), Op(0, "step", "s")
    prio = {a: 5.0, c: 4.0, t0: 3.0, b: 2.0, t1: 1.0, st: 0.0}
    assert bound.list_schedule(deps, d, 2, priority=prio) == 4.5
    # Without the trainer rule (gradient helpers) t0 and t1 may overlap: the chain floor drops
    # to a, a train op, the step (3.0) and the work floor (4.25) binds; worked by hand, the
    # best order still ends at 4.5 (c | a, t0, t1, step beside b: ops do not split), and the
    # search finds it.
    assert bound.chain_floor(deps, d, trainer_serial=False) == 3.0
    assert bound.best_list_schedule(deps, d, 2) == 4.5


def test_without_the_trainer_rule_the_floor_and_the_search_agree_where_the_chain_binds():
    # a -> two train ops of 2 s -> step: one trainer process takes 5 s to the step, two
    # workers with a helper 3 s. The search never ends below the floor of its own rule.
    a, st = Op(0, "rollout", "p", mb=0), Op(0, "step", "s")
    t0, t1 = Op(0, "train", "s", mb=0), Op(0, "train", "s", mb=1)
    deps, d = {a: [], t0: [a], t1: [a], st: [t0, t1]}, {a: 1.0, t0: 2.0, t1: 2.0, st: 0.5}
    for serial, want in ((True, 5.5), (False, 3.5)):
        floor = max(sum(d.values()) / 2, bound.chain_floor(deps, d, trainer_serial=serial))
        assert floor == want
        assert bound.best_list_schedule(deps, d, 2, trainer_serial=serial) == want


def test_idle_causes_split_by_what_the_other_worker_ran():
    rows = [{"kind": "rollout", "agent": "s", "worker": "w0", "t_start": 0.0, "t_end": 4.0},
            {"kind": "train", "agent": "s", "worker": "w1", "t_start": 0.0, "t_end": 1.0},
            {"kind": "train", "agent": "s", "worker": "w0", "t_start": 5.0, "t_end": 6.0}]
    assert bound.idle_causes(rows) == {"w0": {"none": 1.0}, "w1": {"rollout[s]": 3.0, "none": 1.0, "train[s]": 1.0}}


def test_longest_first_renumbers_whole_micro_batches_by_one_agents_rollouts():
    # Iteration 0: the solver's mb 1 took longest, then mb 0, then mb 2; each mb's other ops
    # (the planner's rollout, the solver's train) move with it; step ops (mb -1) stay.
    d = {}
    for mb, (plan_s, solve_s, train_s) in enumerate([(0.1, 2.0, 0.5), (0.2, 5.0, 0.6), (0.3, 1.0, 0.7)]):
        d[Op(0, "rollout", "planner", mb=mb)] = plan_s
        d[Op(0, "rollout", "solver", mb=mb)] = solve_s
        d[Op(0, "train", "solver", mb=mb)] = train_s
    d[Op(0, "step", "solver")] = 0.4
    d[Op(1, "rollout", "solver", mb=0)] = 3.0  # an iteration of one mb keeps it
    out = bound.longest_first(d, "solver")
    assert sorted(out.values()) == sorted(d.values()) and len(out) == len(d)  # the same work
    assert [out[Op(0, "rollout", "solver", mb=m)] for m in range(3)] == [5.0, 2.0, 1.0]
    assert [out[Op(0, "rollout", "planner", mb=m)] for m in range(3)] == [0.2, 0.1, 0.3]
    assert [out[Op(0, "train", "solver", mb=m)] for m in range(3)] == [0.6, 0.5, 0.7]
    assert out[Op(0, "step", "solver")] == 0.4 and out[Op(1, "rollout", "solver", mb=0)] == 3.0
