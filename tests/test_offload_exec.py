"""Offload plans executed by device actors on CPU: a budgeted device
(``cpu?threads=1&mem=...``, the GPU's stand-in) streams weights from host
homes into staging slots while ``cpu`` computes others where they live;
greedy tokens equal one device's, the budget holds (staging counted), and a
throttled CPU device moves work to streaming at the next re-plan."""
import dataclasses

import pytest
import torch

from tessera_actors import models
from tessera_actors.capture import capture_module
import plan_stepper
from plan_stepper import Engine
from tessera_actors.testing import greedy_decode
from tessera_actors.runtime.errors import RemoteError
from tessera_actors.runtime.messages import GetStats
from tessera_actors.plan import single_device_plan
from tessera_actors.planning.offload import Offload, OffloadPlanner, estimate_rates
from tessera_actors.planning.offload.adapt import adapt, predicted_busy
from transport.system import ActorSystem

PROMPT = [1, 2, 3]
PCIE = 3e8   # the rates below give a plan with all three homes


def tiny_model(dtype):
    m = models.get("llama", "tiny", dtype=dtype, seed=0, max_seq=64)
    cap = capture_module(m, m.example_inputs("decode", batch=1))
    g = cap.graph
    w = sum(b.nbytes for b in g.buffers.values() if b.role == "weight")
    rest = sum(b.nbytes for b in g.buffers.values() if b.role != "weight")
    budget = rest + w // 3
    return cap, budget, [f"cpu?threads=1&mem={budget}", "cpu"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(torch.float32)


def plan_for(g, devices, costs=None, ring="slots"):
    costs = costs or estimate_rates(g, devices, switch_s=1e-5)
    return OffloadPlanner(costs=costs, pcie_bps=PCIE, ring=ring).plan(g, devices), costs


@dataclasses.dataclass
class Deployed:
    """A plan on device actors (``tests/plan_stepper.py``: ``Engine``),
    each device's ``Installed`` reply and its busy seconds since ``reset``."""
    engine: Engine
    installed: list
    busy_s: list = dataclasses.field(default_factory=list)
    counted: int = 0

    async def step(self, inputs):
        out = await self.engine.step(inputs)
        self.busy_s = [a + d.busy_s for a, d in zip(self.busy_s or [0.0] * len(self.engine.last), self.engine.last)]
        self.counted += 1
        return out

    def reset(self):
        self.busy_s, self.counted = [], 0


async def deploy(system, graph, plan, values):
    return Deployed(*await plan_stepper.deploy(system, graph, plan, values))


async def greedy(dep, prompt, new):
    tokens, logits = await greedy_decode(dep.step, prompt, new)
    return tokens, [x.float() for x in logits]


async def run(g, plan, values, new=8):
    async with ActorSystem("t") as system:
        dep = await deploy(system, g, plan, values)
        tokens, logits = await greedy(dep, PROMPT, new)
        return tokens, logits, dep


@pytest.mark.parametrize("ring", ["slots", "bytes"])
async def test_split_decode_streams_and_computes_on_the_cpu_with_single_device_tokens(tiny, ring):
    cap, budget, devices = tiny
    g = cap.graph
    plan, _ = plan_for(g, devices, ring=ring)
    off = plan.meta["offload"]
    assert off["ring"] == ring
    assert set(off["choices"]) == {"R", "S", "C"}, off["choices"]
    assert off["streamed"] and plan.kernels_per_device()[1] > 0 and plan.transfers
    want, want_logits, _ = await run(g, single_device_plan(g, "cpu"), cap.values)
    tokens, logits, dep = await run(g, plan, cap.values)
    assert tokens == want
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    # the budgeted device allocated its resident buffers and the slots, within the budget
    assert dep.installed[0].resident_bytes == off["gpu_bytes"] <= budget
    streamed = sum(g.buffers[b].nbytes for b in off["streamed"])
    assert sum(g.buffers[b].nbytes for b in plan.resident[0]) - streamed + off["slots"] * off["slot_bytes"] \
        == dep.installed[0].resident_bytes


async def test_hand_offs_between_co_located_devices_move_every_byte_once(tiny):
    """Each transfer to the co-located peer goes thread to thread
    (:mod:`tessera_actors.execution.handoff`): every transfer of every step arrives once, its
    bytes counted, the logits bitwise those of one device."""
    cap, budget, devices = tiny
    g = cap.graph
    plan, _ = plan_for(g, devices)
    want, want_logits, _ = await run(g, single_device_plan(g, "cpu"), cap.values)
    new = 6
    async with ActorSystem("t") as system:
        dep = await deploy(system, g, plan, cap.values)
        tokens, logits = await greedy(dep, PROMPT, new)
        stats = [(await ref.ask(GetStats())).values for ref in dep.engine.devices]
    assert tokens == want[:new]
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    steps = len(PROMPT) + new - 1
    assert sum(st["direct_transfers"] for st in stats) == steps * len(plan.transfers) > 0
    assert sum(st["direct_bytes"] for st in stats) == steps * sum(t.nbytes for t in plan.transfers)


async def test_the_budget_is_enforced_and_staging_counts(tiny):
    cap, budget, devices = tiny
    g = cap.graph
    plan, _ = plan_for(g, devices)
    # the streamed weights resident instead, on a device whose budget is a byte short of them
    need = sum(g.buffers[b].nbytes for b in plan.resident[0])
    held = dataclasses.replace(plan, meta={}, devices=[f"cpu?threads=1&mem={need - 1}", plan.devices[1]])
    with pytest.raises(RemoteError, match="budget"):
        await run(g, held, cap.values, new=1)
    off = dict(plan.meta["offload"], slots=64)  # staging alone over the budget
    big = dataclasses.replace(plan, meta={"offload": off})
    with pytest.raises(RemoteError, match="staging"):
        await run(g, big, cap.values, new=1)


async def test_a_throttled_cpu_device_moves_its_share_to_streaming_at_the_next_replan(tiny):
    cap, budget, devices = tiny
    g = cap.graph
    plan, costs = plan_for(g, devices)

    async def observed(plan, devices):
        async with ActorSystem("t") as system:
            p = dataclasses.replace(plan, devices=devices)
            dep = await deploy(system, g, p, cap.values)
            await greedy(dep, PROMPT, 2)          # warm-up
            dep.reset()
            tokens, _ = await greedy(dep, [4], 6)
            return [b / dep.counted for b in dep.busy_s], tokens

    # calibrate both devices on an unthrottled run, re-plan
    busy, _ = await observed(plan, devices)
    costs, _ = adapt(costs, predicted_busy(Offload(g, devices, costs, PCIE), plan), busy, tolerance=1.0)
    calm, _ = plan_for(g, devices, costs)
    on_cpu = calm.kernels_per_device()[1]
    assert on_cpu > 0 and "C" in calm.meta["offload"]["choices"]
    # the CPU device slowed down 50x: the share it computed goes to streaming
    slow = [devices[0], "cpu?slow=50"]
    busy, tokens = await observed(calm, slow)
    costs, factors = adapt(costs, predicted_busy(Offload(g, devices, costs, PCIE), calm), busy)
    assert factors[1] > 5   # the busy box may move the other device's factor too; the throttle dominates
    moved, _ = plan_for(g, devices, costs)
    assert moved.kernels_per_device()[1] < on_cpu
    assert moved.meta["offload"]["choices"].count("C") < calm.meta["offload"]["choices"].count("C")
    assert len(moved.meta["offload"]["streamed"]) > len(calm.meta["offload"]["streamed"])


def test_slow_option_round_trips_and_is_checked():
    from tessera_actors.devices import DeviceSpec, DeviceSpecError
    spec = DeviceSpec.parse("cpu?threads=2&slow=4")
    assert spec.slow == 4.0 and DeviceSpec.parse(spec.name) == spec
    with pytest.raises(DeviceSpecError, match="slow"):
        DeviceSpec.parse("cpu?slow=0.5")


def test_streaming_program_copies_each_weight_once_per_step_and_replays_its_pieces(tiny):
    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.execution.backends.cpu import CpuBackend
    from tessera_actors.execution.streaming import StreamingProgram
    from tessera_actors.execution.segments import SegmentRunner
    from tessera_actors.devices import DeviceSpec
    from tessera_actors.execution.inputs import write_inputs
    cap, budget, devices = tiny
    g = cap.graph
    plan, _ = plan_for(g, devices)
    off = plan.meta["offload"]
    cpu = torch.device("cpu")
    everything = sorted(g.buffers)
    ref = AtenProgram(g, cpu, everything)
    prog = StreamingProgram(g, cpu, everything, off["streamed"], off["slots"], off["slot_bytes"],
                            CpuBackend(DeviceSpec.parse("cpu")))
    runner = SegmentRunner(DeviceSpec.parse("cpu"))   # the device's one capture/replay cache
    for p in (ref, prog):
        p.load(cap.values)
        for k in range(len(g.kernels)):
            p.bind(k)
    out = g.meta["output_views"][0]
    for step in range(3):
        inputs = {"input_ids": torch.tensor([[5 + step]]), "positions": torch.tensor([step])}
        for p in (ref, prog):
            write_inputs(p, g, inputs, [b for b in g.buffers if g.buffers[b].role == "input"])
        ref.run(range(len(g.kernels)))
        runner.run(("p", 0), prog, range(len(g.kernels)))
        assert torch.equal(ref.view(out), prog.view(out))
    m, first = len(off["streamed"]), min(off["slots"], len(off["streamed"]))
    # each weight once per step, and the fourth step's first copies queued by the third
    assert prog.copies == 3 * m + first
    assert prog.copied_bytes == (3 * sum(g.buffers[b].nbytes for b in off["streamed"])
                                 + sum(g.buffers[b].nbytes for b in off["streamed"][:first]))
    assert prog.ahead_used == 2 * first   # steps 2 and 3 found their first copies queued
    counts = runner.per_plan["p"]
    pieces = counts["captures"]
    # step 1 eager, step 2 captured and run, step 3 replayed: one unit of the runner per piece
    assert pieces >= m and counts["eager_runs"] == pieces and counts["replays"] == 2 * pieces


def _streaming_pair(tiny, device="cpu", mode="slots", backend=None):
    """A reference program and two streaming programs of the tiny graph on one
    staging ring and one KV cache (a share group's buckets), streaming
    different weights, on ``device`` (the reference on the same device),
    the ring filled as ``mode`` says (``backend``: instead of the device's)."""
    from tessera_actors.execution.program import AtenProgram
    from tessera_actors.execution.backends import backend_for
    from tessera_actors.execution.streaming import Staging, StreamingProgram
    cap, budget, devices = tiny
    g = cap.graph
    readers: dict = {}
    for k in g.kernels:
        for a in k.accesses:
            if g.buffers[a.buffer].role == "weight":
                readers.setdefault(a.buffer, set()).add(k.id)
    order = sorted((b for b, ks in readers.items() if len(ks) == 1), key=lambda b: min(readers[b]))
    mine, theirs = order[1::2][:6], order[0::2][:6]   # interleaved: each program's slots hold the other's weights
    slot = max(g.buffers[b].nbytes for b in mine + theirs)
    be = backend or backend_for(device)
    dev = be.device
    slots = 2 if mode == "slots" else 1   # packed, one slot's bytes hold several weights and wrap within a step
    ring = Staging(dev, slots, slot, be)
    everything = sorted(g.buffers)
    ref = AtenProgram(g, dev, everything)
    state = {b: torch.zeros(max(g.buffers[b].nbytes, 1), dtype=torch.uint8, device=dev) for b in g.buffers
             if g.buffers[b].role == "state"}   # one KV cache, as a share group's
    a, b = (StreamingProgram(g, dev, everything, s, slots, slot, be, shared=state, ring=ring, mode=mode)
            for s in (mine, theirs))
    for p in (ref, a, b):
        p.load(cap.values)
        for k in range(len(g.kernels)):
            p.bind(k)
    return g, cap, ref, a, b


def _step(g, progs, step):
    from tessera_actors.execution.inputs import write_inputs
    inputs = {"input_ids": torch.tensor([[5 + step]]), "positions": torch.tensor([step])}
    for p in progs:
        write_inputs(p, g, inputs, [b for b in g.buffers if g.buffers[b].role == "input"])
        p.run(range(len(g.kernels)))
    out = g.meta["output_views"][0]
    return [p.view(out).clone() for p in progs]


@pytest.mark.parametrize("mode", ["slots", "bytes"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_copies_queued_ahead_are_dropped_when_another_program_takes_the_ring(tiny, device, mode):
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, cap, ref, a, b = _streaming_pair(tiny, device, mode)
    # a, a, b, a, b, b, a: every change of program finds the slots holding the other's weights (on a
    # GPU the copies are queued, so a missing wait shows as a wrong output)
    for step, p in enumerate("aabab" "ba"):
        want, got = _step(g, [ref, a if p == "a" else b], step)
        assert torch.equal(want, got), f"step {step} ({p})"
    first = sum(1 for x in a.layout.after if x < 0)   # a step's copies that overwrite only the step before's
    assert a.ahead_used == first and b.ahead_used == sum(1 for x in b.layout.after if x < 0)   # a -> a, b -> b


def test_a_load_drops_the_copies_queued_ahead(tiny):
    g, cap, ref, a, _ = _streaming_pair(tiny)
    _step(g, [ref, a], 0)
    changed = {bid: torch.zeros_like(v) if bid in a.home else v for bid, v in cap.values.items()}
    for p in (ref, a):
        p.load(changed)
    want, got = _step(g, [ref, a], 1)
    assert torch.equal(want, got)
    assert a.ahead_used == 0


def test_a_load_through_another_program_of_the_group_drops_the_copies_queued_ahead(tiny):
    """Buckets share the host homes: new values loaded through one program
    reach the next step of another that had its first copies queued."""
    from tessera_actors.execution.backends import backend_for
    from tessera_actors.execution.streaming import StreamingProgram
    g, cap, ref, a, _ = _streaming_pair(tiny)
    twin = StreamingProgram(g, a.device, sorted(g.buffers), a.streamed, a.slots, a.ring.slot_bytes,
                            backend_for("cpu"), ring=a.ring, homes=a.home,
                            shared={b: a.arena[b] for b in g.buffers if g.buffers[b].role == "state"})
    for k in range(len(g.kernels)):
        twin.bind(k)
    _step(g, [ref, a], 0)
    assert a.ring.ahead is a
    changed = {bid: v * 0 if bid in a.home else v for bid, v in cap.values.items()}
    for p in (ref, twin):
        p.load(changed)
    want, got = _step(g, [ref, a], 1)
    assert torch.equal(want, got)


def test_forgetting_a_program_settles_its_copies_queued_ahead(tiny):
    from tessera_actors.devices import DeviceSpec
    from tessera_actors.execution.segments import SegmentRunner
    g, cap, ref, a, _ = _streaming_pair(tiny)
    _step(g, [ref, a], 0)
    assert a.ring.ahead is a and a.ahead   # the next step's first copies are queued
    SegmentRunner(DeviceSpec.parse("cpu")).forget("plan", a)   # an uninstall: nothing may write the ring later
    assert a.ring.ahead is None and not a.ahead


async def test_split_decode_in_bfloat16_equals_single_device():
    cap, budget, devices = tiny_model(torch.bfloat16)
    g = cap.graph
    # a CPU DRAM rate under which a split beats the CPU alone on the step model (at the roofline's own
    # rates the tiny bf16 model runs fastest entirely on the unbudgeted CPU)
    plan, _ = plan_for(g, devices, estimate_rates(g, devices, switch_s=1e-5, cpu_bps=3e8))
    assert plan.kernels_per_device()[1] > 0 and plan.transfers
    want, want_logits, _ = await run(g, single_device_plan(g, "cpu"), cap.values)
    tokens, logits, _ = await run(g, plan, cap.values)
    assert tokens == want
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_capture_records_no_kernel_only_a_cpu_has(dtype):
    """The ring tests run the CPU capture on CUDA too: attention is recorded
    whole (``aten.scaled_dot_product_attention``), not as the CPU's flash kernel."""
    from tessera_actors.execution.program import other_device_op
    cap, _, _ = tiny_model(dtype)
    names = {k.payload["op"] for k in cap.graph.kernels}
    assert "aten.scaled_dot_product_attention.default" in names
    assert [n for n in names if other_device_op(n, "cuda")] == []


def test_a_kernel_of_another_device_type_is_refused_by_name(tiny):
    from tessera_actors.execution.allow import KernelRefused
    from tessera_actors.execution.program import AtenProgram
    cap, _, _ = tiny
    g = cap.graph
    k = next(k for k in g.kernels if k.name == "scaled_dot_product_attention")
    g2 = type(g).from_dict(g.to_dict())
    g2.kernels[k.id].payload["op"] = "aten._scaled_dot_product_cudnn_attention.default"
    prog = AtenProgram(g2, torch.device("cpu"), sorted(g2.buffers))
    with pytest.raises(KernelRefused, match="cudnn.*is a cuda kernel, bound on cpu"):
        prog.bind(k.id)
