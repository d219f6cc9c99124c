"""Fixtures shared by the security tests."""
import pytest

from tessera_actors.cluster import LocalCluster
from tessera_actors.runtime.messages import Ping, Pong
from transport.system import ActorSystem


@pytest.fixture
async def warm_node():
    """One node daemon (a cpu device) that answered a ping, and a peer
    system: ``(system, node, ref to its "node" actor)``."""
    async with ActorSystem("peer") as system, LocalCluster(["cpu"]) as cluster:
        n = cluster.nodes[0]
        ref = await system.remote_ref(n.endpoint, "node")
        assert await ref.ask(Ping(b"warm"), timeout=30) == Pong(b"warm")
        yield system, n, ref
