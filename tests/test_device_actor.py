"""Device actors run their segments (runs of kernels between transfers)
eagerly once, then captured and replayed (CUDA graphs on CUDA; the same
logic, trivially, on CPU): greedy decoding through them equals a single
device, step after step.

CPU here; the ``gpu`` tests deploy the same way on ``cuda:0`` with an
SM-limited partition (and on two GPUs when there are two), for graphs from
the aten capture and from inductor (Triton kernels)."""
import asyncio
import gc
import random
import weakref

import pytest
import torch

from actors.device import DeviceActor
from tessera_actors.execution.segments import GRAPHS_ENV, SegmentRunner, graphs_from_env, program_class
from actors.transfer import TransferActor
from tessera_actors import models
from tessera_actors.capture import capture_module
from tessera_actors.devices import DeviceSpec
from plan_stepper import deploy
from tessera_actors.runtime.errors import RemoteError
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import GetStats, Uninstall
from tessera_actors.plan import ContiguousPlanner, build_plan, single_device_plan
from tessera_actors.execution.reference import PlanRunner
from tessera_actors.execution.inputs import write_inputs
from transport.system import ActorSystem
from tessera_actors.testing import greedy_decode, random_assignment

PROMPT = [1, 2, 3]


async def decode(graph, plan, values, new_tokens, graphs=None):
    """Greedy tokens, logits of every generated position, and each device's stats."""
    async with ActorSystem("t") as system:
        engine, _ = await deploy(system, graph, plan, values, graphs)
        tokens, logits = await greedy_decode(engine.step, PROMPT, new_tokens)
        stats = [(await ref.ask(GetStats())).values for ref in engine.devices]
    return tokens, [x.cpu() for x in logits], stats, engine.steps


def segments(plan, d):
    """Runs of kernels device ``d`` executes without a transfer in between."""
    prog = plan.programs[d]
    return sum(st.op == "run" and (i == 0 or prog[i - 1].op != "run") for i, st in enumerate(prog))


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.fixture(scope="module")
def tiny():
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0, max_seq=64)
    return capture_module(m, m.example_inputs("decode", batch=1))


# -- CPU ------------------------------------------------------------------------
async def test_split_decoding_replays_each_segment_and_equals_single_device(tiny):
    g = tiny.graph
    devices = ["cpu?threads=1", "cpu?threads=1"]
    runner = PlanRunner(g, single_device_plan(g, "cpu"), tiny.values)
    want_tokens, _ = await greedy_decode(runner.step, PROMPT, 16)
    ref_tokens, ref_logits, _, _ = await decode(g, single_device_plan(g, devices[0]), tiny.values, 16, graphs=False)
    assert ref_tokens == want_tokens
    plans = [ContiguousPlanner().plan(g, devices),
             build_plan(g, devices, random_assignment(g, 2, random.Random(0), runs=8), name="scattered")]
    assert max(segments(plans[1], d) for d in range(2)) >= 4   # segments between transfers, both ways
    for plan in plans:
        assert plan.transfers, plan.name
        tokens, logits, stats, steps = await decode(g, plan, tiny.values, 16)
        assert tokens == want_tokens, plan.name
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), plan.name
        assert steps == len(PROMPT) + 16 - 1
        for d, st in enumerate(stats):
            n = segments(plan, d)   # each segment: warmed up once, captured once, replayed every later step
            assert st["graphs"] and st["steps"] == steps
            assert (st["eager_runs"], st["captures"], st["units"]) == (n, n, n), (plan.name, d, st)
            assert st["replays"] == n * (steps - 1) and st["capture_failures"] == 0


async def test_graphs_off_runs_every_segment_eagerly_with_the_same_tokens(tiny, monkeypatch):
    g = tiny.graph
    plan = ContiguousPlanner().plan(g, ["cpu", "cpu"])
    on_tokens, on_logits, _, _ = await decode(g, plan, tiny.values, 6)
    monkeypatch.setenv(GRAPHS_ENV, "0")
    tokens, logits, stats, steps = await decode(g, plan, tiny.values, 6)
    assert tokens == on_tokens and all(torch.equal(a, b) for a, b in zip(logits, on_logits))
    for d, st in enumerate(stats):
        assert not st["graphs"] and st["captures"] == st["replays"] == 0
        assert st["eager_runs"] == segments(plan, d) * steps
    monkeypatch.setenv(GRAPHS_ENV, "maybe")
    with pytest.raises(ValueError, match="TESSERA_CUDA_GRAPHS='maybe'"):
        graphs_from_env()
    monkeypatch.delenv(GRAPHS_ENV)
    assert graphs_from_env()


async def test_uninstall_drops_the_captured_segments(tiny):
    g = tiny.graph
    plan = ContiguousPlanner().plan(g, ["cpu", "cpu"])
    async with ActorSystem("t") as system:
        engine, _ = await deploy(system, g, plan, tiny.values)
        await greedy_decode(engine.step, PROMPT, 2)
        dev = engine.devices[0]
        assert (await dev.ask(GetStats())).values["units"] == segments(plan, 0)
        arena = weakref.ref(next(iter(dev._actor.plans["p"].prog.arena.values())))
        await dev.ask(Uninstall("p", wait=True))   # answered once the plan's memory is let go
        st = (await dev.ask(GetStats())).values
        assert st["units"] == 0 and st["plans"] == []
        gc.collect()
        assert arena() is None          # the next plan gets the memory (a GPU budget counts it)


def test_a_segment_that_cannot_be_captured_keeps_running_eagerly(tiny):
    """A capture failure (e.g. a kernel that syncs with the host) costs speed,
    never a result: the segment stays eager and outputs stay exact."""
    g = tiny.graph
    inp = {"input_ids": torch.tensor([[5]]), "positions": torch.tensor([0])}
    want = PlanRunner(g, single_device_plan(g, "cpu"), tiny.values).step(inp)
    runner = SegmentRunner(DeviceSpec.parse("cpu"))

    def refuse(fn, stream, pool=None, warmup=True, current=False):
        raise RuntimeError("operation not permitted when stream is capturing")
    runner.backend.replayable = refuse
    kernels = list(range(len(g.kernels)))
    views = g.meta["output_views"]
    for _ in range(3):   # warm-up, failed capture, eager again
        prog = program_class(g)(g, runner.device, g.buffers)
        prog.load(tiny.values)
        write_inputs(prog, g, inp)
        runner.run(("p", 0), prog, kernels)
        assert all(torch.equal(prog.view(v), w) for v, w in zip(views, want))
    st = runner.stats()
    assert (st["captures"], st["capture_failures"], st["eager_runs"]) == (0, 1, 3)
    assert "stream is capturing" in st["last_capture_error"]


async def test_an_inductor_graph_needs_a_cuda_device():
    from pathlib import Path
    path = Path(__file__).parent / "data" / "graphs" / "llama-decode-b8.tgraph"
    g = KernelGraph.load(path)
    assert program_class(g).__name__ == "TritonProgram"
    plan = single_device_plan(g, "cpu")
    async with ActorSystem("t") as system:
        with pytest.raises(RemoteError, match="needs a CUDA device"):
            await deploy(system, g, plan, {})


# -- GPU: the same deployment on CUDA devices and green-context partitions ------
PAIRS = [
    pytest.param(("cuda:0", "cuda:0?sms=16"), id="cuda0+partition"),
    pytest.param(("cuda:0", "cuda:1"), id="cuda0+cuda1"),
]


@pytest.fixture(scope="module", params=["aten", "inductor"])
def cuda_capture(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0, device="cuda", max_seq=64)
    inp = m.example_inputs("decode", batch=1)
    if request.param == "aten":
        return capture_module(m, inp)
    from tessera_actors.capture.inductor import capture_inductor
    res = capture_inductor(m, inp)
    assert any(k.kind == "ptx" for k in res.graph.kernels)
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("devices", PAIRS)
async def test_cuda_split_decoding_with_captured_segments_matches_single_device(devices, cuda_capture):
    if torch.cuda.device_count() < 1 + max(DeviceSpec.parse(d).index for d in devices):
        pytest.skip(f"needs {1 + max(DeviceSpec.parse(d).index for d in devices)} GPUs")
    g, values = cuda_capture.graph, cuda_capture.values
    new = 16
    ref_tokens, ref_logits, _, _ = await decode(g, single_device_plan(g, "cuda:0"), values, new, graphs=False)
    plan = ContiguousPlanner().plan(g, list(devices))
    assert plan.transfers
    tokens, logits, stats, steps = await decode(g, plan, values, new, graphs=True)
    assert tokens == ref_tokens
    assert min(cosine(a, b) for a, b in zip(logits, ref_logits)) >= 0.999
    for d, st in enumerate(stats):
        n = segments(plan, d)
        assert st["capture_failures"] == 0, st["last_capture_error"]
        assert (st["eager_runs"], st["captures"]) == (n, n), st
        assert st["replays"] == n * (steps - 1), st


async def test_a_device_without_threads_gets_the_process_count_whatever_another_device_set():
    """A new thread starts with the intra-op thread count last set anywhere in
    the process: a ``cpu?threads=1`` device must not make a later ``cpu``
    device single-threaded."""
    from tessera_actors.execution.backends.cpu import INITIAL_THREADS
    async with ActorSystem("t") as system:
        await system.spawn(TransferActor(), "transfer")
        one = await system.spawn(DeviceActor(DeviceSpec.parse("cpu?threads=1")), "one")
        every = await system.spawn(DeviceActor(DeviceSpec.parse("cpu")), "every")
        counts = [ref._actor.worker.submit(torch.get_num_threads).result() for ref in (one, every)]
    assert counts == [1, INITIAL_THREADS]


async def test_steps_sent_at_once_land_in_order_and_a_step_with_outputs_sees_their_writes(tiny):
    """Steps without output bytes are launched one behind another and
    answered as they land; a later step that wants outputs runs once they
    have: every step sees the KV entries the earlier ones wrote, as in a
    sequential run."""
    from tessera_actors.runtime.messages import RunStep
    g = tiny.graph
    plan = single_device_plan(g, "cpu")
    runner = PlanRunner(g, plan, tiny.values)
    feeds = [{"input_ids": torch.tensor([[t]]), "positions": torch.tensor([p])} for p, t in enumerate([5, 9, 2, 7, 3])]
    want = [runner.step(f)[0] for f in feeds]
    greedy = [[0, 0, 0.0, 1.0, 0, 0, 0]]
    async with ActorSystem("t") as system:
        engine, _ = await deploy(system, g, plan, tiny.values)
        dev = engine.devices[0]
        asks = [dev.ask(RunStep("p", i, f, greedy, i == len(feeds) - 1), timeout=60) for i, f in enumerate(feeds)]
        done = await asyncio.gather(*asks)
        stats = (await dev.ask(GetStats())).values
    assert [d.step for d in done] == list(range(len(feeds)))
    assert [d.tokens[0] for d in done] == [int(w[0, -1].argmax()) for w in want]
    assert not any(d.data for d in done[:-1]) and done[-1].data    # only the last step copies its outputs
    assert stats["steps"] == len(feeds)


@pytest.mark.parametrize("spin_s", [0.0, 0.05])
async def test_co_located_devices_hand_transfers_over_directly_with_the_same_tokens(tiny, spin_s):
    """Device actors of one process pass a step's transfers thread to thread,
    not through the transfer actor: with a spin the receiving worker takes
    them itself and runs on (no event-loop hop), without one the loop takes
    them; the tokens and logits are those of one device either way."""
    g = tiny.graph
    devices = ["cpu?threads=1", "cpu?threads=1"]
    ref_tokens, ref_logits, _, _ = await decode(g, single_device_plan(g, devices[0]), tiny.values, 8, graphs=False)
    plan = build_plan(g, devices, random_assignment(g, 2, random.Random(1), runs=6), name="scattered")
    per_step = {d: sum(t.dst == d for t in plan.transfers) for d in range(2)}
    assert min(per_step.values()) >= 2
    async with ActorSystem("t") as system:
        engine, _ = await deploy(system, g, plan, tiny.values, spin_s=spin_s)
        tokens, logits = await greedy_decode(engine.step, PROMPT, 8)
        stats = [(await ref.ask(GetStats())).values for ref in engine.devices]
        moved = (await system.ref("transfer").ask(GetStats())).values
    assert tokens == ref_tokens and all(torch.equal(a.cpu(), b) for a, b in zip(logits, ref_logits))
    steps = len(PROMPT) + 8 - 1
    assert moved["local_transfers"] == 0                  # nothing went through the transfer actor
    for d, st in enumerate(stats):
        assert st["direct_transfers"] == per_step[d] * steps   # counted by the receiver's hand-off
        assert st["taken_on_worker"] + st["taken_on_loop"] == per_step[d] * steps
        if spin_s == 0:
            assert st["taken_on_worker"] == 0
    if spin_s:
        assert sum(st["taken_on_worker"] for st in stats) > 0
