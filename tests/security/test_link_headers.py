"""Data-plane link headers (``Incoming``) from an authenticated peer name a
rendezvous store the node then connects to.  Headers naming a store nobody
serves must not pile up threads, each connect gives up on its own, and the
node still exits 0 at once on SIGTERM."""
import asyncio
import os
import queue
import signal

import torch

from actors.links import CONNECT_S, MAX_CONNECTING, LinkHub
from tessera_actors.cluster import LocalCluster
from tessera_actors.runtime.messages import GetStats, Incoming, Ping, Pong
from transport.system import ActorSystem


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def test_300_headers_to_a_dead_store_leave_few_threads_and_sigterm_exits_0_at_once():
    async with ActorSystem("peer") as system, LocalCluster(["cpu"], stop_timeout=30) as cluster:
        node = cluster.nodes[0]
        transfer = await system.remote_ref(node.endpoint, "transfer")
        await transfer.ask(GetStats(), timeout=30)
        before = threads(node.proc.pid)
        for i in range(300):
            await transfer.tell(Incoming(f"nowhere>node0/gloo/{i}", 0, "p", 0, i, "device0", 0, 16,
                                         "127.0.0.1:1", "gloo", "cpu"))
        await transfer.ask(GetStats(), timeout=30)   # (after the 300 headers in its mailbox)
        during = threads(node.proc.pid)
        assert during - before <= MAX_CONNECTING + 2, f"{during - before} more threads"
        ref = await system.remote_ref(node.endpoint, "node")
        assert await ref.ask(Ping(b"alive"), timeout=10) == Pong(b"alive")
        node.proc.send_signal(signal.SIGTERM)   # while connects are still under way
        rc = await asyncio.wait_for(node.proc.wait(), 3)
    assert rc == 0


def test_a_receive_link_to_a_dead_store_gives_up_within_the_connect_bound():
    hub = LinkHub("127.0.0.1", 120.0)   # the link's own timeout is much longer than the connect's
    got = queue.Queue()
    try:
        hub.receive("nowhere>here/gloo/1", 0, 8, "127.0.0.1:1", "gloo", torch.device("cpu"),
                    lambda data, error: got.put((data, error)))
        data, error = got.get(timeout=CONNECT_S + 20)
    finally:
        hub.close()
    assert data is None and "could not connect link nowhere>here/gloo/1" in error
    assert "\n" not in error   # the reason, not torch's C++ stack
