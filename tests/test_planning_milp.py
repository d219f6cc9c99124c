"""MILP placement on literal graphs: exact plans, memory, state, errors."""
import dataclasses

import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.inflight import fits
from tessera_actors.planning.planner import MilpPlanner, PlannerConfig
from tessera_actors.planning.baselines import single_graph_baselines
from tessera_actors.planning.synthetic import random_costs, transformer_graph

MS = 1e-3
DEVS = ["cuda:0", "cuda:1?sms=32"]


def k(i, *acc, indirect=False):
    return Kernel(i, f"k{i}", "library", tuple(Access(*a) for a in acc), indirect=indirect)


def table(times, mem=(None, None), latency=1e-6, bandwidth=1e12):
    n = len(mem)
    lat = [[0.0 if a == b else latency for b in range(n)] for a in range(n)]
    bw = [[float("inf") if a == b else bandwidth for b in range(n)] for a in range(n)]
    return CostTable([f"cuda:{d}" for d in range(n)], [[t * MS for t in row] for row in times], lat, bw, list(mem))


def chain(n, nbytes=16, weights=()):
    """x -> k0 -> T0 -> k1 -> T1 ... -> out; kernel i also reads weight i if given."""
    bufs = {0: Buffer(0, nbytes, "input")}
    for i in range(n):
        bufs[1 + i] = Buffer(1 + i, nbytes, "output" if i == n - 1 else "temp")
    ks = []
    for i in range(n):
        acc = [(i, 0, nbytes, "r"), (1 + i, 0, nbytes, "w")]
        if i < len(weights):
            wid = 100 + i
            bufs[wid] = Buffer(wid, weights[i], "weight")
            acc.append((wid, 0, weights[i], "r"))
        ks.append(k(i, *acc))
    return KernelGraph(ks, bufs, inputs={"x": 0}, outputs=[n])


def plan(g, costs, mode, **cfg):
    return MilpPlanner(costs, PlannerConfig(**cfg)).plan(g, costs.devices, mode)


@pytest.mark.parametrize("mode", ["latency", "throughput"])
def test_kernels_go_where_they_are_fast(mode):
    g = chain(4)
    costs = table([[1, 10], [1, 10], [10, 1], [10, 1]])
    p = plan(g, costs, mode, fallback=False)
    assert p.assignment == [0, 0, 1, 1]
    assert p.meta["source"] == "milp"
    comm = 1e-6 + 16 / 1e12
    assert p.predicted_step_s == pytest.approx(4 * MS + comm)
    assert p.meta["solver"]["mip_gap"] <= 0.01


def test_memory_limit_forces_weights_apart():
    g = chain(2, weights=(600, 600))
    costs = table([[1, 3], [1, 2]], mem=(1000, 1000))
    p = plan(g, costs, "latency")
    assert p.assignment == [0, 1]
    assert all(r <= 1000 for r in p.resident_bytes(g))
    # Without the budget both go to the fast device.
    assert plan(g, dataclasses.replace(costs, mem=[None, None]), "latency").assignment == [0, 0]


def test_model_larger_than_all_devices_names_shortfall():
    g = chain(2, weights=(600, 600))          # 16*3 + 1200 = 1248 bytes
    costs = table([[1, 3], [1, 2]], mem=(500, 500))
    with pytest.raises(PlanError, match="short by 248 bytes"):
        plan(g, costs, "throughput")


def test_kernel_larger_than_any_device_names_device_shortfall():
    bufs = {0: Buffer(0, 16, "input"), 1: Buffer(1, 600, "weight"), 2: Buffer(2, 600, "weight"),
            3: Buffer(3, 16, "output")}
    g = KernelGraph([k(0, (0, 0, 16, "r"), (1, 0, 600, "r"), (2, 0, 600, "r"), (3, 0, 16, "w"))], bufs)
    costs = table([[1, 1]], mem=(1000, 1000))
    with pytest.raises(PlanError, match=r"short by 232 bytes in total.*short by 232\)"):
        plan(g, costs, "latency")


def test_state_group_stays_on_one_device():
    bufs = {0: Buffer(0, 16, "input"), 1: Buffer(1, 64, "state"), 2: Buffer(2, 16, "temp"),
            3: Buffer(3, 16, "output")}
    g = KernelGraph([k(0, (0, 0, 16, "r"), (1, 0, 64, "rw"), (2, 0, 16, "w")),
                     k(1, (2, 0, 16, "rw")),
                     k(2, (2, 0, 16, "r"), (1, 0, 64, "r"), (3, 0, 16, "w"))], bufs)
    costs = table([[1, 10], [5, 5], [10, 1.5]])
    for mode in ("latency", "throughput"):
        p = plan(g, costs, mode)
        assert p.assignment[0] == p.assignment[2]


def test_indirect_kernel_keeps_its_neighbours():
    g = chain(3)
    g = KernelGraph([g.kernels[0], Kernel(1, "gather", "ptx", g.kernels[1].accesses, indirect=True),
                     g.kernels[2]], g.buffers, g.inputs, g.outputs)
    costs = table([[1, 10], [1, 1], [10, 1]])
    p = plan(g, costs, "latency")
    assert len(set(p.assignment)) == 1


def test_unknown_mode_is_an_error():
    with pytest.raises(PlanError, match="mode"):
        plan(chain(2), table([[1, 1], [1, 1]]), "fastest")


@pytest.mark.parametrize("seed,ndev", [(0, 2), (1, 2), (2, 3)])
def test_throughput_plan_beats_every_baseline(seed, ndev):
    g = transformer_graph(6, hidden=512, tokens=32)
    devs = ["cuda:0"] + [f"cuda:{i}?sms=32" for i in range(1, ndev)]
    costs = random_costs(g, devs, seed=seed)
    p = plan(g, costs, "throughput")
    thr = p.meta["predicted"]["throughput"]
    for b in single_graph_baselines(g, devs, costs):
        assert b.throughput is not None
        assert thr >= b.throughput * (1 - 1e-9), (b.name, b.throughput, thr)


def test_repeated_layers_shrink_the_problem():
    g = transformer_graph(40)
    costs = random_costs(g, DEVS, seed=3)
    p = plan(g, costs, "throughput")
    solver = p.meta["solver"]
    assert solver["classes"] <= 2 * 12 + 2
    assert solver["tied_kernels"] == 480
    assert solver["status"] == "optimal"


def test_latency_plan_memory_budget_on_synthetic_model():
    g = transformer_graph(8, hidden=512, tokens=16)
    total = sum(b.nbytes for b in g.buffers.values())
    devs = [f"cuda:0?mem={int(total * 0.6)}", f"cuda:1?sms=32&mem={int(total * 0.6)}"]
    costs = random_costs(g, devs, seed=4)
    p = plan(g, costs, "latency")
    assert len(set(p.assignment)) == 2
    assert all(r <= m for r, m in zip(p.resident_bytes(g), costs.mem))


def test_layers_inferred_from_scope_and_names():
    """A capture that left layer/signature empty: layers come from the
    module path, repeated kernels from their names."""
    src = transformer_graph(6, hidden=256, tokens=8)
    ks = [Kernel(x.id, x.name, x.kind, x.accesses, flops=x.flops, bytes=x.bytes, scope=x.scope) for x in src.kernels]
    g = KernelGraph(ks, src.buffers, src.inputs, src.outputs)
    p = plan(g, random_costs(g, DEVS, seed=1), "throughput")
    assert p.meta["solver"]["tied_kernels"] == 72


def test_inflight_limited_by_activation_memory():
    g = transformer_graph(6, hidden=256, tokens=8)
    costs = random_costs(g, DEVS, seed=0)
    free = plan(g, costs, "throughput")
    assert free.microbatches > 2
    res = free.resident_bytes(g)
    act = [sum(g.buffers[b].nbytes for b in bufs if g.buffers[b].role != "weight") for bufs in free.resident]
    tight = dataclasses.replace(costs, mem=[r + a for r, a in zip(res, act)])     # room for two micro-batches on the same split
    p = plan(g, tight, "throughput")
    assert not any(fits(g, p, tight, p.microbatches))
    if p.assignment == free.assignment:
        assert p.microbatches <= 2
