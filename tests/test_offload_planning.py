"""Offload planning on literal graphs: the three choices per weight under a
GPU budget, exact plans from given rates, and the baselines and bound."""
import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.offload import (Offload, OffloadPlanner, gpu_only, ideal, layer_offload, streaming,
                                             choose_homes)

MS = 1e-3
W = 1024      # bytes of each weight (a multiple of staging.ALIGN: a slot takes its bytes, no more)
A = 16        # bytes of each activation


def chain(n):
    """x -> k0 -> t0 -> k1 -> ... -> out; kernel i reads weight 100+i; layer i."""
    bufs = {0: Buffer(0, A, "input")}
    ks = []
    for i in range(n):
        bufs[1 + i] = Buffer(1 + i, A, "output" if i == n - 1 else "temp")
        bufs[100 + i] = Buffer(100 + i, W, "weight", name=f"w{i}")
        ks.append(Kernel(i, f"k{i}", "library", (Access(i, 0, A, "r"), Access(100 + i, 0, W, "r"),
                                                   Access(1 + i, 0, A, "w")), layer=i))
    return KernelGraph(ks, bufs, inputs={"x": 0}, outputs=[n])


def rates(devs, gpu_ms, cpu_ms, latency=0.0):
    """times[k] = [gpu, cpu] in device order of ``devs`` (gpu first)."""
    times = [[g * MS, c * MS] for g, c in zip(gpu_ms, cpu_ms)]
    lat = [[0.0, latency], [latency, 0.0]]
    bw = [[float("inf")] * 2 for _ in range(2)]
    return CostTable(list(devs), times, lat, bw, [None, None], "profile")


def offload(n, budget, gpu_ms, cpu_ms, pcie_bps=W / MS, latency=0.0):
    devs = [f"cuda:0?mem={budget}", "cpu?threads=12"]
    g = chain(n)
    return Offload(g, devs, rates(devs, gpu_ms, cpu_ms, latency), pcie_bps=pcie_bps)


def letters(p):
    return "".join(p.choice[u] for u in sorted(p.choice))


def test_a_model_that_fits_stays_resident():
    o = offload(4, 4 * W + 5 * A, [0.1] * 4, [1.0] * 4)
    p, st = choose_homes(o)
    assert letters(p) == "RRRR" and p.streamed == [] and p.assignment == [0, 0, 0, 0]
    assert st.step_s == pytest.approx(0.4 * MS)
    assert gpu_only(o)[1].step_s == pytest.approx(0.4 * MS)
    assert ideal(o) == pytest.approx(0.4 * MS)


def test_non_resident_weights_split_between_cpu_and_streaming():
    # room for 2 resident weights and 2 staging slots: w0, w1 resident; of
    # w2..w5 (1 ms on the cpu, 1 ms over pcie) two run on the cpu while the
    # other two stream beside them
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6)
    p, st = choose_homes(o)
    assert o.gpu_bytes(p) <= o.budget
    assert letters(p)[:2] == "RR" and letters(p).count("C") == 2 and letters(p).count("S") == 2
    assert p.slots == 2 and p.slot_bytes == W
    # the cpu computes 2 ms while the two copies (2 ms) run beside it from t=0
    assert st.step_s == pytest.approx((0.2 + 2.0 + 0.2) * MS)
    lay = layer_offload(o)[1]     # 4 weights resident (no staging), 2 on the cpu
    assert lay.step_s == pytest.approx((0.4 + 2.0) * MS)
    stream = streaming(o)[1]       # 2 resident, 4 streamed one after the other
    assert stream.step_s == pytest.approx((4.0 + 0.1) * MS)
    assert gpu_only(o) is None
    assert ideal(o) <= st.step_s


def test_expected_plan_exactly():
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6)
    p, st = choose_homes(o)
    # ties (2.4 ms) go to the first pattern tried: w2 on the cpu while w3 and
    # w5 stream from t=0 into the two slots
    assert letters(p) == "RRCSCS" and p.assignment == [0, 0, 1, 0, 1, 0]
    assert p.streamed == [103, 105]
    plan = OffloadPlanner(costs=o.costs, pcie_bps=o.pcie_bps).plan(o.graph, o.devices)
    assert plan.assignment == p.assignment and plan.meta["offload"]["streamed"] == [103, 105]
    assert plan.meta["offload"]["gpu_bytes"] <= plan.meta["offload"]["budget"]


def test_a_slow_cpu_shifts_the_share_to_streaming():
    # the same budget with a cpu 4x slower: everything not resident streams
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [4.0] * 6)
    p, _ = choose_homes(o)
    assert letters(p) == "RRSSSS"
    fast, _ = choose_homes(offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6))
    assert letters(fast).count("C") > letters(p).count("C")


def test_switch_latency_keeps_cpu_work_together():
    # 1 ms per hand-off between the devices: alternating C/S costs more than a
    # cpu run of two weights
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6, latency=1 * MS)
    p, st = choose_homes(o)
    a = p.assignment
    assert sum(a[i] != a[i - 1] for i in range(1, len(a))) <= 2


def test_a_budget_below_any_weight_runs_everything_on_the_cpu():
    o = offload(4, A, [0.1] * 4, [1.0] * 4)
    p, st = choose_homes(o)
    assert letters(p) == "CCCC" and p.assignment == [1, 1, 1, 1] and o.gpu_bytes(p) == 0
    assert st.step_s == pytest.approx(4.0 * MS)


def test_needs_one_budgeted_device_and_a_cpu():
    g = chain(2)
    with pytest.raises(PlanError, match="one budgeted device"):
        OffloadPlanner().plan(g, ["cuda:0", "cpu"])


def test_tessera_is_between_the_ideal_and_the_coarse_policies():
    import random
    rng = random.Random(3)
    for trial in range(12):
        n = rng.randint(3, 9)
        gpu_ms = [rng.uniform(0.05, 0.3) for _ in range(n)]
        cpu_ms = [rng.uniform(0.5, 3.0) for _ in range(n)]
        budget = (n + 1) * A + rng.randint(0, n) * W
        o = offload(n, budget, gpu_ms, cpu_ms, pcie_bps=rng.uniform(0.5, 2.0) * W / MS,
                    latency=rng.choice([0.0, 0.1 * MS]))
        p, st = choose_homes(o)
        assert o.gpu_bytes(p) <= o.budget, trial
        for base in (layer_offload(o), streaming(o), gpu_only(o)):
            if base is not None:
                assert st.step_s <= base[1].step_s + 1e-12, trial
        assert ideal(o) <= st.step_s + 1e-12, trial


def test_every_bucket_of_a_real_size_llama_follows_the_first_ones_homes():
    """The buckets of a served Llama-3.1-8B (meta capture) under an 8 GiB
    budget, at rates measured on an H200 (which once gave a prompt chunk a
    KV cache on the CPU, refused by the scheduler's state pins): each later
    bucket keeps the first one's KV cache homes and adds no resident weight."""
    import torch
    from tessera_actors.planning.pinning import respects, state_homes
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.buckets import bucket_inputs, buckets_for, shaped
    from tessera_actors import models
    from tessera_actors.capture import capture_module
    cfg = EngineConfig(model="llama", size="real", devices="cuda:0?mem=8GiB,cpu?threads=12", dtype="bfloat16",
                       max_seqs=8, max_model_len=576, decode_buckets=(1, 8), prefill_buckets=(32, 512),
                       kv_windows=(), mode="latency")
    meta = models.get("llama", "real", dtype=torch.bfloat16, device="meta", max_batch=8, max_seq=576)
    graphs = {}
    for b in buckets_for(cfg):
        with shaped(meta, b):
            graphs[b.name] = capture_module(meta, bucket_inputs(b)).graph
    devs = ["cuda:0?mem=8589934592", "cpu?threads=12"]
    planner = OffloadPlanner(pcie_bps=54887931598.7, cpu_bps=39881608221.9, switch_s=347.93e-6, reserve=320 << 20)
    ref = "decode:8@0"
    planner.expect([g for n, g in graphs.items() if n != ref])
    first = planner.plan(graphs[ref], devs)
    homes = state_homes(graphs[ref], first.assignment)

    def resident(g, plan):
        streamed = set(plan.meta["offload"]["streamed"])
        return {g.buffers[b].name for b in plan.resident[0]
                if g.buffers[b].role == "weight" and b not in streamed and g.buffers[b].nbytes > 1 << 20}
    mine = resident(graphs[ref], first)
    assert 5e9 < sum(b.nbytes for b in graphs[ref].buffers.values() if b.name in mine and b.role == "weight") < 8e9
    for name, g in graphs.items():
        if name == ref:
            continue
        plan = planner.plan(g, devs)
        assert respects(g, plan.assignment, homes, {}), name
        assert resident(g, plan) <= mine, name


def test_a_budget_only_the_cpu_placement_fits_is_placed_not_refused():
    """Residents can bring more than their own bytes (the KV cache follows
    its kernels onto the GPU); shrinking past them must still try no
    resident weight at all (the default buckets of a tiny Llama served with
    a small budget were once refused with 'cannot hold even the KV cache')."""
    from tessera_actors.serving.config import EngineConfig
    from tessera_actors.serving.deploy import load_served_model
    devices = ["cpu?threads=1&mem=400000", "cpu"]
    cfg = EngineConfig(model="llama", size="tiny", devices=",".join(devices), max_model_len=64)
    served = load_served_model(cfg)
    ref = f"decode:{cfg.max_seqs}@0"
    planner = OffloadPlanner(pcie_bps=1e8, cpu_bps=1e8)
    planner.expect([g for name, g in served.graphs.items() if name != ref])
    plan = planner.plan(served.graphs[ref], devices)
    assert plan.meta["offload"]["gpu_bytes"] <= 400000


def sized_chain(sizes, names):
    """``chain`` with weights of ``sizes`` bytes named ``names``."""
    g = chain(len(sizes))
    for i, (n, name) in enumerate(zip(sizes, names)):
        g.buffers[100 + i] = Buffer(100 + i, n, "weight", name=name)
    g.kernels[:] = [Kernel(k.id, k.name, k.kind, (k.accesses[0], Access(100 + k.id, 0, sizes[k.id], "r"),
                                                   k.accesses[2]), layer=k.layer) for k in g.kernels]
    return g


def test_a_packed_ring_keeps_the_copy_engine_further_ahead_on_the_model():
    # two big weights, a long CPU kernel, eight small weights: during the CPU kernel two slots take
    # two small copies, the packed ring (as many bytes) all eight
    sizes = [W, W, W] + [W // 4] * 8
    devs = [f"cuda:0?mem={10 * W}", "cpu?threads=12"]
    g = sized_chain(sizes, [f"w{i}" for i in range(len(sizes))])
    costs = rates(devs, [0.05] * len(sizes), [4.0] * len(sizes))
    steps = {}
    for ring in ("slots", "bytes"):
        o = Offload(g, devs, costs, pcie_bps=W / MS, ring=ring)
        choice = {u: "S" for u in o.units}
        choice[sorted(o.units, key=lambda u: o.kernels[u][0])[2]] = "C"   # the CPU kernel
        p = o.placement(choice, 2, W)
        steps[ring] = o.simulate(p).step_s
    assert steps["bytes"] < steps["slots"] - 1 * MS   # the same copies, queued earlier
    assert Offload(g, devs, costs, ring="bytes").placement({}, 2).ring == "bytes"
    with pytest.raises(PlanError, match="ring"):
        Offload(g, devs, costs, ring="pages")


def test_units_are_classed_by_their_weight_names_without_layer_numbers():
    from tessera_actors.planning.offload import unit_classes
    sizes = [W] * 6
    devs = [f"cuda:0?mem={10 * W}", "cpu?threads=12"]
    g = sized_chain(sizes, [f"layers.{i // 2}.{'ab'[i % 2]}.weight" for i in range(6)])
    o = Offload(g, devs, rates(devs, [0.05] * 6, [5.0] * 6))
    names = [[g.buffers[o.units[u][0]].name for u in cls] for cls in unit_classes(o, sorted(o.units))]
    assert names == [["layers.0.a.weight", "layers.1.a.weight", "layers.2.a.weight"],
                     ["layers.0.b.weight", "layers.1.b.weight", "layers.2.b.weight"]]


def test_the_packed_ring_planner_plans_within_the_budget_and_says_so():
    sizes = [W // 4, W, W // 4, W] * 3
    devs = [f"cuda:0?mem={4 * W}", "cpu?threads=12"]
    g = sized_chain(sizes, [f"layers.{i // 2}.{'ab'[i % 2]}" for i in range(len(sizes))])
    costs = rates(devs, [0.05] * len(sizes), [1.0] * len(sizes))
    plan = OffloadPlanner(costs=costs, pcie_bps=W / MS, ring="bytes").plan(g, devs)
    off = plan.meta["offload"]
    assert off["ring"] == "bytes" and off["gpu_bytes"] <= off["budget"]
    with pytest.raises(PlanError, match="ring"):
        OffloadPlanner(costs=costs, ring="pages")


def test_expert_offload_puts_the_routed_experts_on_the_cpu_and_keeps_the_rest():
    # two layers of attention, router and routed experts (llama.cpp -ot exps=CPU)
    names = [f"layers.{i // 4}." + n for i, n in enumerate(["attn.wq.weight", "experts.router.weight",
                                                            "experts.gate_up", "experts.down"] * 2)]
    g = sized_chain([W] * 8, names)
    devs = [f"cuda:0?mem={5 * W}", "cpu?threads=12"]
    o = Offload(g, devs, rates(devs, [0.1] * 8, [1.0] * 8), pcie_bps=W / MS)
    from tessera_actors.planning.offload import expert_offload, routed_experts
    assert sorted(g.buffers[o.units[u][0]].name for u in routed_experts(o)) == [
        "layers.0.experts.down", "layers.0.experts.gate_up", "layers.1.experts.down", "layers.1.experts.gate_up"]
    p, st = expert_offload(o)
    assert letters(p) == "RRCCRRCC" and p.streamed == []
    assert st.step_s == pytest.approx((4 * 0.1 + 4 * 1.0) * MS)
    # Tessera has it among its candidates: never slower on the model
    assert choose_homes(o)[1].step_s <= st.step_s + 1e-12
    # the rest over the budget, or a dense model: no expert offload
    assert expert_offload(Offload(g, [f"cuda:0?mem={3 * W}", devs[1]], o.costs)) is None
    assert expert_offload(offload(4, 4 * W, [0.1] * 4, [1.0] * 4)) is None
    plan = OffloadPlanner(costs=o.costs, policy="expert_offload").plan(g, devs)
    assert plan.name == "offload-expert_offload" and plan.meta["offload"]["choices"] == "RRCCRRCC"


def test_the_step_models_terms_add_up_to_its_step():
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6, latency=0.05 * MS)
    p, st = choose_homes(o)
    t = st.terms(o.gpu)
    assert t["kernel_overlap_s"] == 0   # a chain: nothing to overlap
    assert t["gpu_kernels_s"] + t["cpu_kernels_s"] + t["handoff_s"] + t["copy_wait_s"] == pytest.approx(st.step_s)
    assert t["handoffs"] == sum(p.assignment[k] != p.assignment[k - 1] for k in range(1, 6))
    assert t["handoff_s"] == pytest.approx(t["handoffs"] * 0.05 * MS)
    assert t["copy_engine_s"] == pytest.approx(len(p.streamed) * MS)


def test_a_plan_carries_the_terms_of_its_own_prediction():
    """The terms a plan reports (the offload bench's ``predicted_terms``) are
    the planner's for that plan: they add up to its predicted step and its
    CPU kernels are the time of the kernels it put on the CPU - for the
    first graph and for one that follows it."""
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6, latency=0.05 * MS)
    planner = OffloadPlanner(costs=o.costs, pcie_bps=o.pcie_bps)
    for plan in (planner.plan(o.graph, o.devices), planner.plan(o.graph, o.devices)):   # first, then followed
        off = plan.meta["offload"]
        t = off["terms"]
        on_cpu = [k for k, d in enumerate(plan.assignment) if d == 1]
        assert on_cpu and t["cpu_kernels_s"] == pytest.approx(sum(o.costs.times[k][1] for k in on_cpu))
        assert t["step_s"] == pytest.approx(plan.predicted_step_s)
        assert t["gpu_kernels_s"] + t["cpu_kernels_s"] - t["kernel_overlap_s"] + t["handoff_s"] + t["copy_wait_s"] \
            == pytest.approx(t["step_s"])
        assert off["busy_s"] == pytest.approx([t["gpu_kernels_s"], t["cpu_kernels_s"]])


def test_a_placement_is_scored_only_on_the_graph_it_was_made_for():
    """A plan of one capture of a model scored on another capture's graph
    (the bench once scored the offload rows' aten plans on the GPU-only
    reference's inductor graph: 782 CPU kernels predicted at 5 us) is an
    error, not a number."""
    o = offload(6, 4 * W + 7 * A, [0.1] * 6, [1.0] * 6)
    p, _ = choose_homes(o)
    other = offload(4, 4 * W + 7 * A, [0.1] * 4, [1.0] * 4)
    with pytest.raises(PlanError, match="another capture"):
        other.simulate(p)
