"""Faults are bounded: a node leaves when its scheduler is gone (within its
lease) and registers again with a restarted one; a restarted node rejoins
under its name; transfers for steps that never come are bounded and expire."""
import asyncio

import pytest
import torch

from tessera_actors.execution.inbox import Inbox
from actors.lease import LEASE_SUFFIX
from actors.scheduler import SchedulerActor
from tessera_actors.cluster import LocalCluster
from tessera_actors.runtime.errors import RemoteError
from tessera_actors.runtime.messages import GetStats, Heartbeat, Ok, Register, Registered, ReportLost
from tessera_actors.plan import ContiguousPlanner
from transport.system import ActorSystem


class WatchedScheduler(SchedulerActor):
    """A scheduler that lets the test wait for a registration (an event, not a sleep)."""

    def __init__(self):
        super().__init__(ContiguousPlanner())
        self.registered = asyncio.Event()

    async def register(self, msg):
        reply = await super().register(msg)
        self.registered.set()
        return reply


async def test_restarted_node_rejoins_under_its_name():
    async with ActorSystem("s") as system:
        sched = await system.spawn(SchedulerActor(ContiguousPlanner()), "scheduler")
        lease = system.ref("scheduler" + LEASE_SUFFIX)
        assert await sched.ask(Register("n1", "tcp://127.0.0.1:1", ["cpu"], 10)) == Registered("n1", 0)
        assert await sched.ask(Register("n2", "tcp://127.0.0.1:2", ["cpu"], 11)) == Registered("n2", 1)
        assert await lease.ask(Heartbeat("n1", 1)) == Ok("renewed")
        await sched.ask(ReportLost("tcp://127.0.0.1:1", "killed"))
        assert (await sched.ask(GetStats())).values["lost"] == ["n1"]
        with pytest.raises(RemoteError, match="rejoins with devices"):
            await sched.ask(Register("n1", "tcp://127.0.0.1:3", ["cpu", "cpu"], 12))
        assert await sched.ask(Register("n1", "tcp://127.0.0.1:3", ["cpu"], 12)) == Registered("n1", 0)
        stats = (await sched.ask(GetStats())).values
        assert stats["nodes"] == ["n1", "n2"] and stats["lost"] == [] and stats["devices"] == ["cpu", "cpu"]
        with pytest.raises(RemoteError, match="not registered") as info:
            await lease.ask(Heartbeat("stranger", 1))
        assert info.value.kind == "LookupError"


async def test_node_exits_within_its_lease_when_the_scheduler_is_gone():
    system = ActorSystem("s")
    try:
        sched = WatchedScheduler()
        await system.spawn(sched, "scheduler")
        address = await system.listen()
        async with LocalCluster(["cpu"], scheduler=address, node_args=["--lease", "2", "--heartbeat", "0.25"]) as c:
            await asyncio.wait_for(sched.registered.wait(), 30)
            with pytest.raises(RemoteError, match="already registered .* and alive"):   # the live node keeps its name
                await system.ref("scheduler").ask(Register("node0", "tcp://127.0.0.1:3", ["cpu"], 12))
            loop = asyncio.get_running_loop()
            await system.shutdown()   # the scheduler's process is gone as far as the node can tell
            gone = loop.time()
            rc = await asyncio.wait_for(c.nodes[0].proc.wait(), 10)
            assert rc == 3 and loop.time() - gone <= 10.0   # the bound; the lease is 2 s, the rest is exit
            assert b"answered no heartbeat" in await c.nodes[0].proc.stderr.read()
    finally:
        await system.shutdown()


async def test_node_registers_again_with_a_restarted_scheduler():
    first = ActorSystem("s1")
    sched = WatchedScheduler()
    await first.spawn(sched, "scheduler")
    address = await first.listen()
    async with LocalCluster(["cpu"], scheduler=address, node_args=["--lease", "6", "--heartbeat", "0.25"]) as c:
        await asyncio.wait_for(sched.registered.wait(), 30)
        await first.shutdown()
        async with ActorSystem("s2") as second:   # a new scheduler at the same address, knowing nobody
            again = WatchedScheduler()
            await second.spawn(again, "scheduler")
            await second.listen(address)
            await asyncio.wait_for(again.registered.wait(), 10)
            assert (await second.ref("scheduler").ask(GetStats())).values["nodes"] == ["node0"]
            assert c.nodes[0].proc.returncode is None


async def test_transfers_for_steps_that_never_come_are_bounded_and_expire():
    inbox = Inbox(max_early=3, ttl=1e9)
    for step in range(5):
        inbox.put(step, 0, 0, torch.ones(4))
    assert inbox.pending() == 3 and inbox.dropped == 2

    async def write(offset, data):
        written.append(data)
    written = []
    await inbox.receive(1, 0, 16, write, timeout=5, what="t")   # a kept one is still received
    assert len(written) == 1 and inbox.pending() == 2
    aging = Inbox(max_early=100, ttl=-1.0)   # everything is already past its time to live
    aging.put(7, 0, 0, torch.ones(4))
    aging.put(8, 0, 0, torch.ones(4))        # the next arrival expires the old one
    assert aging.pending() == 1 and aging.dropped == 1
