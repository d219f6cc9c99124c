"""The list schedule: the queue order the executor runs and the mix
planner scores."""
import pytest

from tessera_actors.plan import build_plan
from tessera_actors.planning.schedule import list_schedule

from test_planning_mix import DEVS, chain


def test_replicas_interleave_and_keep_both_devices_busy():
    g, costs = chain([(1.0, 2.0)] * 4)     # L 4 s per step, R 8 s
    reps = [build_plan(g, DEVS, [d] * len(g.kernels)) for d in range(2)]
    s = list_schedule(reps, costs, total_steps=24)
    assert s.steps == [16, 8]               # L twice as fast
    assert s.makespan_s == pytest.approx(64.0)
    assert s.throughput == pytest.approx(3 / 8)
    assert s.busy_s == pytest.approx([64.0, 64.0])


def test_exact_step_counts_and_a_started_step_is_always_finished():
    g, costs = chain([(1.0, 1.0)] * 4)
    split = build_plan(g, DEVS, [0, 0, 1, 1])          # two segments: L then R
    s = list_schedule([split, split], costs, steps=[3, 2])
    assert s.steps == [3, 2] and len(s.order) == 2 * (3 + 2)
    # slot 1 goes on L while slot 0's first step is on R: pipelined, not serial
    assert s.order[:3] == [0, 0, 1] or s.order[:3] == [0, 1, 0]
    assert s.makespan_s < 5 * 4.0


def test_without_costs_kernels_count_one_unit_each():
    g, _ = chain([(1.0, 1.0)] * 4)
    plan = build_plan(g, DEVS, [0] * 4)
    assert list_schedule([plan], None, steps=[2]).makespan_s == pytest.approx(8.0)


def test_bad_arguments_are_refused():
    g, costs = chain([(1.0, 1.0)] * 4)
    plan = build_plan(g, DEVS, [0] * 4)
    with pytest.raises(ValueError, match="total_steps or steps"):
        list_schedule([plan], costs)
    with pytest.raises(ValueError, match="step counts"):
        list_schedule([plan], costs, steps=[1, 2])


def test_an_always_ready_replica_does_not_starve_a_slot_that_hops():
    g, costs = chain([(1.0, 1.0)] * 4)
    replica = build_plan(g, DEVS, [0] * 4, breaks=[1, 2, 3])     # four short pieces on L
    hop = build_plan(g, DEVS, [0, 1, 1, 0])                      # L, R, L
    s = list_schedule([replica, hop], costs, total_steps=12)
    assert s.steps[1] >= 3                                       # the hopping slot keeps going
