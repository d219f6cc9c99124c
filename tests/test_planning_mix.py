"""Mixes (a plan per micro-batch slot) on the committed CUDA graph fixtures
and on literal graphs: never below a single-plan baseline, within a step
barrier of Request Distribution, inside memory budgets."""
from pathlib import Path

import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import PlanError, build_plan
from tessera_actors.planning import CostTable, MilpPlanner
from tessera_actors.planning.baselines import single_graph_baselines
from tessera_actors.planning.mix import best_mix, mix_memory, predict_mix

FIXTURES = sorted((Path(__file__).parent / "data" / "graphs").glob("*.tgraph"))
DEVS = ["cuda:0", "cuda:1?sms=32"]


def chain(times, weight_bytes=100):
    """A chain of kernels, each reading its own weight: costs given per device."""
    bufs = {i: Buffer(i, weight_bytes, "weight") for i in range(len(times))}
    n = len(times)
    bufs.update({n + i: Buffer(n + i, 8, "temp") for i in range(n + 1)})
    ks = [Kernel(i, f"k{i}", "library", (Access(i, 0, weight_bytes, "r"), Access(n + i, 0, 8, "r"),
                                         Access(n + i + 1, 0, 8, "w"))) for i in range(n)]
    g = KernelGraph(ks, bufs, inputs={}, outputs=[2 * n])
    costs = CostTable(DEVS, [list(t) for t in times], [[0, 1e-3], [1e-3, 0]], [[float("inf"), 1e6], [1e6, float("inf")]],
                      [None, None], "test")
    return g, costs


def test_equal_devices_mix_is_request_distribution():
    g, costs = chain([(1.0, 1.0)] * 4)
    mix = best_mix(g, DEVS, costs, MilpPlanner(costs).plan(g, DEVS, "throughput"))
    assert mix.throughput == pytest.approx(0.5)    # = Request Distribution's 1/4 + 1/4


def test_the_schedule_score_and_the_rate_lp_agree_on_request_distribution():
    g, costs = chain([(1.0, 2.0)] * 4)
    lp = best_mix(g, DEVS, costs, family=False, score="lp")
    sched = best_mix(g, DEVS, costs, family=False)
    assert sched.throughput == pytest.approx(lp.throughput) == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="score"):
        best_mix(g, DEVS, costs, score="guess")


def test_one_replica_per_device_is_request_distribution_exactly():
    g, costs = chain([(1.0, 2.0)] * 4)         # R takes twice as long on everything
    assert best_mix(g, DEVS, costs).throughput >= 3 / 8 * (1 - 1e-9)
    mix = best_mix(g, DEVS, costs, family=False)   # replicas only
    assert mix.meta["counts"] == [1, 1]
    assert mix.rates == pytest.approx([1 / 4, 1 / 8])
    assert mix.throughput == pytest.approx(3 / 8)           # RD's 1/4 + 1/8


def test_kernel_slots_add_to_replicas_where_kernels_disagree():
    """Half the kernels are 3x faster on L, half 3x faster on R: a replica
    per device leaves each device slow on half its work; a kernel-level plan
    beside them does better than Request Distribution."""
    g, costs = chain([(1.0, 3.0), (3.0, 1.0)] * 4)
    plan = build_plan(g, DEVS, [0, 1] * 4)     # every kernel where it is fast
    mix = best_mix(g, DEVS, costs, plan)
    rd = 2 / 16                                 # each replica: 16 s per execution
    assert mix.throughput > 1.2 * rd
    assert sum(mix.meta["counts"][2:]) >= 1     # a kernel-level plan is in the mix
    found = best_mix(g, DEVS, costs)            # without being handed one: the offload family
    assert found.throughput > 1.2 * rd


def test_memory_budget_excludes_replicas_that_do_not_fit():
    g, costs = chain([(1.0, 1.0)] * 4)
    weights = sum(b.nbytes for b in g.buffers.values() if b.role == "weight")
    tight = costs.with_mem([None, weights // 2])    # R cannot hold the whole model
    mix = best_mix(g, DEVS, tight, MilpPlanner(tight).plan(g, DEVS, "throughput"))
    assert all(h <= m for h, m in zip(mix.meta["held_bytes"], tight.mem) if m is not None)
    assert f"homo[{DEVS[1]}]" not in [p.name for p in mix.plans]   # no replica on R
    with pytest.raises(PlanError, match="no mix"):
        best_mix(g, DEVS, costs.with_mem([weights // 2, weights // 2]))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_tessera_never_below_a_baseline(path):
    g = KernelGraph.load(path)
    costs = CostTable.estimate(g, DEVS)
    plan = MilpPlanner(costs).plan(g, DEVS, "throughput")
    mix = best_mix(g, DEVS, costs, plan)
    tessera = max(plan.meta["predicted"]["throughput"], mix.throughput)
    for b in single_graph_baselines(g, DEVS, costs):
        if b.throughput is None:
            continue
        # a mix is scored on a finite schedule, whose tail costs it a little
        assert tessera >= b.throughput * (1 - 5e-3), b.name
    held = mix_memory(g, mix.plans)
    assert len(held) == 2
    assert predict_mix(mix.plans, costs)[1] >= mix.throughput * (1 - 1e-6)   # the LP bounds the schedule


def test_many_devices_are_searched_without_enumerating_every_mix():
    """Six devices and twelve slots: far too many count vectors to enumerate;
    the search starts from Request Distribution and one-plan mixes instead."""
    devs = [f"cpu?threads={i + 1}" for i in range(6)]
    g, _ = chain([(1.0, 1.0)] * 4)
    times = [[1.0 + d for d in range(6)] for _ in range(4)]
    lat = [[0.0 if a == b else 1e-3 for b in range(6)] for a in range(6)]
    bw = [[float("inf") if a == b else 1e6 for b in range(6)] for a in range(6)]
    costs = CostTable(devs, times, lat, bw, [None] * 6, "test")
    mix = best_mix(g, devs, costs, max_slots=12)
    rd = sum(1 / (4 * (1.0 + d)) for d in range(6))
    assert mix.throughput >= rd * 0.97          # the finite schedule's tail: replicas end unevenly
    assert mix.meta["mixes_scored"] < 2000
