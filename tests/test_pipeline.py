"""The pipelined executor on every backend: CPU here, CUDA (and SM-limited
green-context partitions) on the GPU machine - the same tests."""
import random

import pytest
import torch

from actors.backends.base import backend_for
from tessera_actors import models
from tessera_actors.capture import capture_module
from tessera_actors.engine import greedy_decode
from tessera_actors.pipeline import PipelinedExecutor
from tessera_actors.plan import ContiguousPlanner, build_plan, single_device_plan
from tessera_actors.testing import random_assignment

PAIRS = [
    pytest.param(("cpu", "cpu"), id="cpu+cpu"),
    pytest.param(("cuda:0", "cuda:0?sms=16"), id="cuda0+partition", marks=pytest.mark.gpu),
    pytest.param(("cuda:0", "cuda:1?sms=32"), id="cuda0+cuda1-32sms", marks=pytest.mark.gpu),
]


def need(devices):
    n = max((int(d.split(":")[1][0]) for d in devices if d.startswith("cuda")), default=-1) + 1
    if n and torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def captured(device, dtype, batch=1, name="llama"):
    m = models.get(name, "tiny", dtype=dtype, seed=0, device=device, max_seq=128)
    inp = {k: v.to(device) for k, v in m.example_inputs("decode", batch=batch).items()}
    return capture_module(m, inp), inp


@pytest.mark.parametrize("streams", ["device", "slot"])
@pytest.mark.parametrize("devices", PAIRS)
def test_random_splits_with_two_microbatches_equal_single_device(devices, streams):
    need(devices)
    backends = [backend_for(d) for d in devices]
    dev = backends[0].device
    res, inp = captured(dev, torch.float32, batch=2)
    single = PipelinedExecutor(res.graph, single_device_plan(res.graph, devices[0]), res.values, backends[:1])
    other = {k: (v + 1) % 7 if k == "input_ids" else v for k, v in inp.items()}
    want = [single.step([inp])[0], single.step([other])[0]]
    rng = random.Random(0)
    for _ in range(4):
        plan = build_plan(res.graph, list(devices), random_assignment(res.graph, 2, rng))
        ex = PipelinedExecutor(res.graph, plan, res.values, backends, microbatches=2, streams=streams)
        assert (ex.compute[0][0] is ex.compute[0][1]) == (streams == "device")
        got = ex.step([inp, other])
        for w, g in zip(want, got):
            if dev.type == "cpu":
                assert torch.equal(w[0], g[0])
            else:
                assert cosine(w[0], g[0]) >= 0.999


@pytest.mark.parametrize("devices", PAIRS)
def test_split_greedy_decoding_matches_single_device(devices):
    need(devices)
    backends = [backend_for(d) for d in devices]
    dev = backends[0].device
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    res, _ = captured(dev, dtype)
    steps = 16 if dev.type == "cpu" else 64

    def stepper(ex):
        async def step(inputs):
            return ex.step([{k: v.to(dev) for k, v in inputs.items()}])[0]
        return step
    import asyncio
    single = PipelinedExecutor(res.graph, single_device_plan(res.graph, devices[0]), res.values, backends[:1])
    split = PipelinedExecutor(res.graph, ContiguousPlanner().plan(res.graph, list(devices)), res.values, backends)
    t1, l1 = asyncio.run(greedy_decode(stepper(single), [1, 2, 3], steps))
    t2, l2 = asyncio.run(greedy_decode(stepper(split), [1, 2, 3], steps))
    assert t1 == t2
    if dev.type == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    else:
        assert min(cosine(a, b) for a, b in zip(l1, l2)) >= 0.999


def test_segments_of_several_slots_are_queued_interleaved():
    """On streams a device shares, queue order is execution order: slot 1's
    first segment must not wait behind slot 0's whole step."""
    res, inp = captured(torch.device("cpu"), torch.float32)
    g = res.graph
    plan = next(p for p in (build_plan(g, ["cpu", "cpu"], random_assignment(g, 2, random.Random(i)))
                            for i in range(50)) if len(p.segments) >= 4)
    bes = [backend_for("cpu"), backend_for("cpu")]
    ex = PipelinedExecutor(g, plan, res.values, bes, microbatches=2)
    order = []
    for m in range(2):
        for sid, fn in list(ex.runs[m].items()):
            ex.runs[m][sid] = (lambda fn=fn, m=m, sid=sid: (order.append((m, sid)), fn()))
    got = ex.step([inp, inp])
    segs = [s.id for s in plan.segments]
    first_dev = plan.segments[0].device
    on_first = [(m, sid) for m, sid in order if plan.segments[sid].device == first_dev]
    assert on_first[:2] == [(0, segs[0]), (1, segs[0])]   # slot 1 starts before slot 0 goes on there
    assert sorted(order) == sorted((m, s) for m in range(2) for s in segs)
    want = PipelinedExecutor(g, single_device_plan(g, "cpu"), res.values, bes[:1]).step([inp])[0]
    assert all(torch.equal(a, b) for a, b in zip(got[0], want)) and all(torch.equal(a, b) for a, b in zip(got[1], want))


def test_a_replica_cut_into_pieces_computes_the_same():
    from tessera_actors.plan import split_long_segments
    res, inp = captured(torch.device("cpu"), torch.float32)
    g = res.graph
    whole = single_device_plan(g, "cpu")
    times = [[1.0] for _ in g.kernels]
    pieces = split_long_segments(g, whole, times, quantum=10.0)
    assert len(pieces.segments) == -(-len(g.kernels) // 10) and pieces.assignment == whole.assignment
    assert all(len(s.kernels) <= 10 for s in pieces.segments)
    be = [backend_for("cpu")]
    want = PipelinedExecutor(g, whole, res.values, be).step([inp])[0]
    got = PipelinedExecutor(g, pieces, res.values, be).step([inp])[0]
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_executor_rejects_an_unknown_stream_layout():
    res, _ = captured(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="streams"):
        PipelinedExecutor(res.graph, single_device_plan(res.graph, "cpu"), res.values,
                          [backend_for("cpu")], streams="many")


def test_executor_rejects_mismatched_backends():
    res, _ = captured("cpu", torch.float32)
    plan = ContiguousPlanner().plan(res.graph, ["cpu", "cpu"])
    with pytest.raises(ValueError, match="1 backends for a plan of 2 devices"):
        PipelinedExecutor(res.graph, plan, res.values, [backend_for("cpu")])


@pytest.mark.parametrize("devices", PAIRS)
def test_a_plan_per_microbatch_slot_mixes_replicas_and_splits(devices):
    """Slot 0 split over both devices, slot 1 all on the first, slot 2 all on
    the second (Request Distribution's replicas are one-device slots): every
    slot's outputs equal the single-device run of its own inputs."""
    need(devices)
    backends = [backend_for(d) for d in devices]
    dev = backends[0].device
    res, inp = captured(dev, torch.float32, batch=2)
    g = res.graph
    inputs = [{k: (v + j) % 7 if k == "input_ids" else v for k, v in inp.items()} for j in range(3)]
    plans = [build_plan(g, list(devices), random_assignment(g, 2, random.Random(1))),
             build_plan(g, list(devices), [0] * len(g.kernels), name="replica0"),
             build_plan(g, list(devices), [1] * len(g.kernels), name="replica1")]
    ex = PipelinedExecutor(g, plans, res.values, backends)
    assert ex.mb == 3
    for _ in range(2):   # a second step checks state and cross-step ordering too
        got = ex.step(inputs)
    want2 = []
    for i in inputs:  # the reference also takes two steps per slot
        single2 = PipelinedExecutor(g, single_device_plan(g, devices[0]), res.values, backends[:1])
        single2.step([i])
        want2.append(single2.step([i])[0])
    for w, o in zip(want2, got):
        if dev.type == "cpu":
            assert torch.equal(w[0], o[0])
        else:
            assert cosine(w[0], o[0]) >= 0.999
    held = ex.allocated_bytes()
    weights = sum(b.nbytes for b in g.buffers.values() if b.role == "weight")
    assert held[0] >= weights and held[1] >= weights   # every device holds the weights once, not per slot
    assert held[0] < 2 * weights + 3 * sum(b.nbytes for b in g.buffers.values() if b.role != "weight")


@pytest.mark.parametrize("devices", PAIRS)
def test_slots_step_at_their_own_pace(devices):
    """Slot 0 decodes three positions while slot 1 decodes one; each slot's
    state (its KV cache) and outputs follow its own steps only."""
    need(devices)
    backends = [backend_for(d) for d in devices]
    dev = backends[0].device
    res, inp = captured(dev, torch.float32, batch=2)
    g = res.graph
    at = [{**inp, "positions": inp["positions"] + p} for p in range(3)]

    def reference(n):
        ex = PipelinedExecutor(g, single_device_plan(g, devices[0]), res.values, backends[:1])
        for p in range(n):
            out = ex.step([at[p]])
        return out[0]
    plans = [build_plan(g, list(devices), random_assignment(g, 2, random.Random(3))),
             build_plan(g, list(devices), [1] * len(g.kernels))]
    ex = PipelinedExecutor(g, plans, res.values, backends)
    ex.enqueue([at[0], at[0]])
    ex.enqueue([at[1]], slots=[0])
    ex.enqueue([at[2]], slots=[0])
    ex.synchronize()
    got = ex.outputs()
    three, one = reference(3), reference(1)
    assert not torch.equal(three[0], one[0])     # the steps matter
    for want, out in ((three, got[0]), (one, got[1])):
        if dev.type == "cpu":
            assert torch.equal(want[0], out[0])
        else:
            assert cosine(want[0], out[0]) >= 0.999
    assert ex.time_slots([2, 1]) > 0
