"""The discrete-event prediction against hand-computed schedules."""
import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import build_plan
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.simulate import simulate

MS = 1e-3


def pipeline():
    """k0 on A (2 ms) writes 1000 bytes that k1 on B (3 ms) reads; the link
    takes 0.5 ms + 1000 B / 1 MB/s = 1.5 ms."""
    bufs = {0: Buffer(0, 8, "input"), 1: Buffer(1, 1000, "temp"), 2: Buffer(2, 8, "output")}
    g = KernelGraph([Kernel(0, "k0", accesses=(Access(0, 0, 8, "r"), Access(1, 0, 1000, "w"))),
                     Kernel(1, "k1", accesses=(Access(1, 0, 1000, "r"), Access(2, 0, 8, "w")))], bufs)
    costs = CostTable(["cuda:0", "cuda:1"], [[2 * MS, 9.0], [9.0, 3 * MS]],
                      [[0.0, 0.5 * MS], [0.5 * MS, 0.0]], [[float("inf"), 1e6], [1e6, float("inf")]],
                      [None, None])
    return g, costs, build_plan(g, costs.devices, [0, 1])


def test_two_device_pipeline_step_time():
    g, costs, plan = pipeline()
    pred = simulate(plan, costs, inflight=1)
    assert pred.step_s == pytest.approx(6.5 * MS)
    assert pred.throughput == pytest.approx(1 / (6.5 * MS))
    assert pred.busy == pytest.approx([2 / 6.5, 3 / 6.5])


def test_pipelining_reaches_the_bottleneck():
    g, costs, plan = pipeline()
    # Three in flight: B (3 ms per item) is the bottleneck.
    assert simulate(plan, costs, inflight=3).throughput == pytest.approx(1 / (3 * MS))
    # Two in flight: an item is admitted when the one two earlier finished,
    # so finishes alternate 3.5 ms and 3 ms apart.
    assert simulate(plan, costs, inflight=2).throughput == pytest.approx(2 / (6.5 * MS))


def test_link_is_one_transfer_at_a_time():
    g, costs, plan = pipeline()
    costs.latency[0][1] = 4 * MS           # link 5 ms per transfer: now the bottleneck
    pred = simulate(plan, costs, inflight=4)
    assert pred.step_s == pytest.approx(10 * MS)
    assert pred.throughput == pytest.approx(1 / (5 * MS))


def test_events_are_recorded_in_order():
    g, costs, plan = pipeline()
    pred = simulate(plan, costs, inflight=1, record=True)
    assert [(e.resource, e.kind, round(e.start / MS, 6), round(e.end / MS, 6)) for e in pred.events] == [
        ("cuda:0", "run", 0.0, 2.0), ("cuda:0->cuda:1", "xfer", 2.0, 3.5), ("cuda:1", "run", 3.5, 6.5)]


def test_two_plans_share_a_device_in_admission_order():
    """The one step-time model over [(plan, slots)]: two jobs on one device,
    one slot each; the device runs whichever micro-batch was admitted first."""
    from tessera_actors.planning.timing import Programs, run
    a = Programs([[("run", 0)]], [2 * MS], {})
    b = Programs([[("run", 0)]], [3 * MS], {})
    r = run([(a, 1), (b, 1)], [2, 2])
    got = sorted((j, round(f / MS, 6)) for j, f in zip(r.job, r.finish))
    assert got == [(0, 2.0), (0, 7.0), (1, 5.0), (1, 10.0)]
    assert r.busy == pytest.approx([10 * MS])


def test_a_copy_engine_runs_copies_in_order_beside_the_kernels():
    """Copies on a copy-engine channel overlap the device's kernels; a reader
    waits for its copy; the second copy is sent once the first reader ran."""
    from tessera_actors.planning.timing import Programs, run
    prog = [("send", 0), ("recv", 0), ("run", 0), ("send", 1), ("recv", 1), ("run", 1)]
    p = Programs([prog], [2 * MS, 2 * MS], {0: ("copy", 0, 1 * MS), 1: ("copy", 0, 3 * MS)})
    r = run([(p, 1)], [1], record=True)
    assert r.finish[0] == pytest.approx(8 * MS)        # copy 0-1, run 1-3, copy 3-6, run 6-8
    assert [(e.kind, round(e.start / MS, 6)) for e in r.events] == [
        ("xfer", 0.0), ("run", 1.0), ("xfer", 3.0), ("run", 6.0)]
