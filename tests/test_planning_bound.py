"""The placement bound (planning/bound.py) on literal graphs whose optimum is
known, and the MILP against it and against Request Distribution."""
import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.baselines import request_distribution
from tessera_actors.planning.bound import placement_bound
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.planner import MilpPlanner

MS = 1e-3


def chain(n, act=16, weight=0):
    """x -> k0 -> T0 -> k1 -> ... -> out; kernel i reads its own weight when ``weight``."""
    bufs = {0: Buffer(0, act, "input")}
    ks = []
    for i in range(n):
        bufs[1 + i] = Buffer(1 + i, act, "output" if i == n - 1 else "temp")
        acc = [Access(i, 0, act, "r"), Access(1 + i, 0, act, "w")]
        if weight:
            bufs[100 + i] = Buffer(100 + i, weight, "weight", f"w{i}")
            acc.append(Access(100 + i, 0, weight, "r"))
        ks.append(Kernel(i, f"k{i}", "library", tuple(acc)))
    return KernelGraph(ks, bufs, inputs={"x": 0}, outputs=[n])


def table(times, mem=(None, None), latency=1e-7, bandwidth=1e12):
    lat = [[0.0, latency], [latency, 0.0]]
    bw = [[float("inf"), bandwidth], [bandwidth, float("inf")]]
    return CostTable(["cuda:0", "cuda:1"], [[t * MS for t in row] for row in times], lat, bw, list(mem))


def opposite(n_pairs=4):
    """Kernels alternating 1 ms on device 0 / 3 ms on device 1 and the reverse:
    each device alone takes 4 ms a pair, the best split 1 ms on each."""
    return chain(2 * n_pairs), table([[1, 3] if i % 2 == 0 else [3, 1] for i in range(2 * n_pairs)])


def test_opposite_affinities_bound_is_the_optimum_and_the_milp_beats_replicas():
    g, costs = opposite()
    b = placement_bound([(g, costs, 1.0)])
    # every kernel on the device it suits: 4 x 1 ms on each device, in parallel
    assert b.tau_s == pytest.approx(4 * MS, rel=1e-6)
    assert b.throughput == pytest.approx(250.0, rel=1e-6)
    rd = request_distribution(g, costs.devices, costs)
    assert rd.throughput == pytest.approx(2 / (16 * MS))          # two replicas of 16 ms
    plan = MilpPlanner(costs).plan(g, costs.devices, "throughput")
    assert [plan.assignment[i] for i in range(8)] == [0, 1] * 4
    thr = plan.meta["predicted"]["throughput"]
    assert thr >= 1.3 * rd.throughput
    assert thr <= b.throughput * (1 + 1e-9)


def test_bound_is_request_distribution_when_devices_agree():
    """Kernels that agree on which device is faster leave only the replicas' sum."""
    g = chain(4)
    costs = table([[1, 2]] * 4)
    b = placement_bound([(g, costs, 1.0)])
    rd = request_distribution(g, costs.devices, costs)
    assert b.throughput == pytest.approx(rd.throughput, rel=1e-6)


def test_bound_counts_the_link():
    """A split that must move 1 GB per step over a 1 GB/s link is link-bound."""
    g = chain(2, act=10**9)
    costs = table([[1, 1000], [1000, 1]], bandwidth=1e9)
    b = placement_bound([(g, costs, 1.0)])
    # a share a of k0 and 1 - a of k1 on device 0: both devices compute a + 1000 (1 - a) ms, the
    # link moves the (2a - 1) of the activation produced where it is not consumed: equal at a = 2000/2999
    assert b.tau_s == pytest.approx(1001 / 2999, rel=1e-6)


def test_memory_budget_limits_the_bound():
    """Weights of 1000 bytes per kernel, 2000 bytes of budget each: the fast
    device holds at most half the weights, so at most half the work."""
    g = chain(4, weight=1000)
    costs = table([[1, 100]] * 4, mem=(2000, 2000))
    b = placement_bound([(g, costs, 1.0)])
    assert b.tau_s == pytest.approx(200 * MS, rel=1e-6)      # 2 kernels' worth on device 1 at 100 ms
    with pytest.raises(PlanError, match="cannot hold"):
        placement_bound([(g, table([[1, 1]] * 4, mem=(1000, 1000)), 1.0)])


def test_bound_over_a_workload_of_two_graphs():
    """Units of 3 executions of one graph and 1 of another add up per device."""
    g1, c1 = opposite(1)
    g2 = chain(1)
    c2 = table([[2, 2]])
    b = placement_bound([(g1, c1, 3.0), (g2, c2, 1.0)])
    # g1: 1 ms on each device per execution (x3); g2: 2 ms split evenly
    assert b.tau_s == pytest.approx(4 * MS, rel=1e-6)
