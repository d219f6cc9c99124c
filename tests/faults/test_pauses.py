"""A paused node is not a dead one: real node daemons (``LocalCluster``,
``AsyncEngine(nodes=...)``) stopped with SIGSTOP and resumed with SIGCONT.

* a node paused for longer than its lease resumes, heartbeats again and
  keeps its registration (it used to exit with status 3);
* the scheduler: a placement waiting on a paused node does not hold up its
  other answers, and is abandoned as soon as that node is reported lost
  (not after ``install_timeout``); a loss is answered at once even when the
  plans it takes down must be uninstalled from a paused survivor;
* under streams, each node of two paused in turn is suspected, its steps
  re-routed to the other, and re-admitted without a restart once it answers:
  every stream ends with the tokens of a fault-free run, both nodes serve
  again and ``health()["lost"]`` is empty; the engine never declares itself
  dead while a node answers, even when the only node left is paused - also
  when that node is paused while the engine is still placing on it (the
  placement is abandoned, not waited on for ``install_timeout``).

Each pause lasts until the side that should notice it has (the scheduler
counts the node lost, the engine re-placed without it): conditions with
deadlines, no sleeps.
"""
import asyncio
import os
import signal
from contextlib import asynccontextmanager

import pytest

from actors.graph import GraphActor
from actors.scheduler import SchedulerActor
from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.cluster import LocalCluster
from tessera_actors.plan import ContiguousPlanner
from tessera_actors.runtime.errors import RemoteError
from tessera_actors.runtime.messages import GetStats, Place, Readmit, ReportLost
from transport.system import ActorSystem

SMALL = dict(model="smollm2", size="tiny", max_model_len=512, decode_buckets=(1, 2, 4, 8), prefill_buckets=(16, 64))
NODES = ["cpu?threads=1", "cpu?threads=1"]
PROMPTS = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(6)]
GREEDY = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


async def until(condition, timeout: float, what: str, poll: float = 0.02):
    """Wait for ``condition()`` (sync or async) to hold, checking every ``poll`` s, for at most ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(poll)


async def test_a_node_paused_longer_than_its_lease_resumes_and_keeps_its_registration():
    async with ActorSystem("s") as system:
        await system.spawn(SchedulerActor(ContiguousPlanner(), heartbeat_timeout=1.0), "scheduler")
        address = await system.listen()
        sched = system.ref("scheduler")

        async def lost() -> list:
            return (await sched.ask(GetStats())).values["lost"]
        async with LocalCluster(["cpu"], scheduler=address, node_args=["--lease", "2", "--heartbeat", "0.25"]) as c:
            node = c.nodes[0].proc
            await until(lambda: sched.ask(GetStats()), 30, "a scheduler answer")
            await until(lambda: _registered_and_live(sched, "node0"), 30, "node0 registered")
            loop = asyncio.get_running_loop()
            os.kill(node.pid, signal.SIGSTOP)
            stopped = loop.time()
            try:   # paused until the scheduler counts it lost and its own 2 s lease is long over
                await until(lambda: _lost_and_after(sched, "node0", loop, stopped + 3.0), 30, "node0 counted lost")
            finally:
                os.kill(node.pid, signal.SIGCONT)
            await until(lambda: _registered_and_live(sched, "node0"), 10, "node0 heartbeating again")
            assert node.returncode is None
            assert await lost() == []


async def _registered_and_live(sched, name: str) -> bool:
    st = (await sched.ask(GetStats())).values
    return name in st["nodes"] and name not in st["lost"]


async def _lost_and_after(sched, name: str, loop, t: float) -> bool:
    return loop.time() >= t and name in (await sched.ask(GetStats())).values["lost"]


async def _stream(eng, prompt, counts: list, i: int) -> list[int]:
    toks = []
    async for out in eng.generate(prompt, GREEDY):
        toks += out.token_ids
        counts[i] = len(toks)
    return toks


async def _pause_until_replaced(eng, node: int) -> None:
    """SIGSTOP node ``node`` until the engine has re-placed without it, then SIGCONT."""
    proc = eng.deployment.cluster.nodes[node].proc
    endpoint = eng.deployment.cluster.nodes[node].endpoint
    generation = eng.stats()["generation"]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        await until(lambda: endpoint in eng.health()["lost"] and eng.stats()["generation"] > generation
                    and eng.health()["ok"], 60, f"node{node} suspected and the engine re-placed without it")
        assert eng.stats()["placement"]["devices"] == [NODES[1 - node]]
    finally:
        os.kill(proc.pid, signal.SIGCONT)


async def test_each_node_paused_in_turn_is_suspected_rerouted_and_readmitted_and_no_stream_changes():
    async with AsyncEngine(devices="cpu", max_seqs=8, **SMALL) as single:
        reference = await asyncio.gather(*(_stream(single, p, [0] * len(PROMPTS), i) for i, p in enumerate(PROMPTS)))
    async with AsyncEngine(nodes=NODES, max_seqs=8, watch_processes=False, **SMALL) as eng:
        await eng.wait_placed()
        for node in (1, 0):   # the second pause is of the node the first one's streams moved to
            counts = [0] * len(PROMPTS)
            streams = [asyncio.ensure_future(_stream(eng, p, counts, i)) for i, p in enumerate(PROMPTS)]
            await until(lambda: min(counts) >= 4, 120, "every stream started")
            await _pause_until_replaced(eng, node)
            await until(lambda: eng.health()["lost"] == [] and len(eng.stats()["placement"].get("devices", [])) == 2,
                        60, f"node{node} re-admitted and placed on")
            assert await asyncio.wait_for(asyncio.gather(*streams), 300) == reference
        stats = eng.stats()
        assert all(n.proc.returncode is None for n in eng.deployment.cluster.nodes)   # nobody was restarted
        assert stats["recoveries"] == 2 and stats["readmissions"] >= 2
        assert eng.health()["ok"]


async def test_the_engine_waits_for_a_paused_node_when_no_other_is_left():
    async with AsyncEngine(devices="cpu", max_seqs=8, **SMALL) as single:
        reference = await asyncio.gather(*(_stream(single, p, [0] * len(PROMPTS), i) for i, p in enumerate(PROMPTS)))
    async with AsyncEngine(nodes=NODES, max_seqs=8, watch_processes=False, **SMALL) as eng:
        await eng.wait_placed()
        counts = [0] * len(PROMPTS)
        streams = [asyncio.ensure_future(_stream(eng, p, counts, i)) for i, p in enumerate(PROMPTS)]
        await until(lambda: min(counts) >= 4, 120, "every stream started")
        procs = [n.proc for n in eng.deployment.cluster.nodes]
        generation = eng.stats()["generation"]
        os.kill(procs[1].pid, signal.SIGSTOP)
        try:
            await until(lambda: len(eng.health()["lost"]) == 1 and eng.stats()["generation"] > generation
                        and eng.stats()["placement"].get("devices") == [NODES[0]], 60, "node1 suspected, re-placed")
            os.kill(procs[0].pid, signal.SIGSTOP)   # now the only node left is paused too
            await until(lambda: len(eng.health()["lost"]) == 2, 60, "node0 suspected")
        finally:
            os.kill(procs[1].pid, signal.SIGCONT)
        await until(lambda: len(eng.health()["lost"]) == 1, 60, "node1 re-admitted")
        os.kill(procs[0].pid, signal.SIGCONT)
        assert await asyncio.wait_for(asyncio.gather(*streams), 300) == reference
        assert eng.health()["error"] is None


def two_kernel_graph():
    """Two kernels of 64 bytes each: the contiguous planner puts one on each of two devices."""
    from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
    kernels, buffers = [], {}
    for b in (0, 1):
        out = {"ref": {"t": [b, 0, [64], [1], "uint8"]}, "alias": False}
        kernels.append(Kernel(b, f"k{b}", "library", (Access(b, 0, 64, "w"),),
                              payload={"op": "aten.zeros.default", "args": [[64]], "kwargs": {"dtype": {"dt": "uint8"}},
                                       "outs": [out]}))
        buffers[b] = Buffer(b, 64, "output")
    return KernelGraph(kernels, buffers, outputs=[0, 1])


@asynccontextmanager
async def scheduler_and_two_nodes():
    """A scheduler (leases long enough that only ``ReportLost`` counts a node lost) and two node daemons."""
    async with ActorSystem("s") as system:
        await system.spawn(GraphActor(two_kernel_graph()), "graph")
        await system.spawn(SchedulerActor(ContiguousPlanner(), heartbeat_timeout=300.0), "scheduler")
        address = await system.listen()
        sched = system.ref("scheduler")
        async with LocalCluster(["cpu", "cpu"], scheduler=address) as cluster:
            await until(lambda: _registered_and_live(sched, "node1"), 30, "node1 registered")
            await until(lambda: _registered_and_live(sched, "node0"), 30, "node0 registered")
            devices = [await system.remote_ref(n.endpoint, "device0") for n in cluster.nodes]
            yield sched, cluster, devices


async def _plans(device) -> list:
    return (await device.ask(GetStats(), timeout=10)).values["plans"]


async def test_a_placement_onto_a_node_paused_meanwhile_is_abandoned_once_the_node_is_reported_lost():
    async with scheduler_and_two_nodes() as (sched, cluster, (dev_a, dev_b)):
        paused = cluster.nodes[1]
        os.kill(paused.proc.pid, signal.SIGSTOP)
        try:
            placing = asyncio.ensure_future(sched.ask(Place("p", "latency"), timeout=120))
            await until(lambda: _has(dev_a, "p"), 30, "node0's half of the plan installed (node1's waits)")
            assert not placing.done()
            stats = await sched.ask(GetStats(), timeout=2)   # the placement does not hold up the scheduler
            assert stats.values["lost"] == []
            await sched.ask(ReportLost(paused.endpoint, "paused"), timeout=2)
            with pytest.raises(RemoteError, match=f"abandoned: the node at {paused.endpoint} was reported lost"):
                await asyncio.wait_for(placing, 5)
            await until(lambda: _lacks(dev_a, "p"), 10, "node0's half uninstalled")
        finally:
            os.kill(paused.proc.pid, signal.SIGCONT)
        await sched.ask(Readmit(paused.endpoint), timeout=30)
        assert await _plans(dev_b) == []   # its half, installed once it resumed, went at the re-admission
        placed = await sched.ask(Place("q", "latency"), timeout=60)   # and both serve the next placement
        assert sorted(ep for _, ep, _ in placed.routes) == sorted(n.endpoint for n in cluster.nodes)


async def test_a_loss_is_answered_at_once_while_a_paused_survivors_uninstalls_wait():
    async with scheduler_and_two_nodes() as (sched, cluster, (_, dev_b)):
        for i in range(4):
            await sched.ask(Place(f"p{i}", "latency"), timeout=60)
        assert await _plans(dev_b) == [f"p{i}" for i in range(4)]
        paused = cluster.nodes[1]
        os.kill(paused.proc.pid, signal.SIGSTOP)
        try:   # node0 lost: its plans go from node1, which is paused (each uninstall waits up to 5 s)
            await sched.ask(ReportLost(cluster.nodes[0].endpoint, "killed"), timeout=2)
            stats = (await sched.ask(GetStats(), timeout=2)).values
            assert stats["lost"] == ["node0"] and stats["plans"] == []
        finally:
            os.kill(paused.proc.pid, signal.SIGCONT)
        await until(lambda: _lacks_all(dev_b), 30, "node1's halves uninstalled once it resumed")


async def _has(device, plan: str) -> bool:
    return plan in await _plans(device)


async def _lacks(device, plan: str) -> bool:
    return plan not in await _plans(device)


async def _lacks_all(device) -> bool:
    return await _plans(device) == []
