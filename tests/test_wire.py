"""Every socket takes frames of at most ``wire.MAX_WIRE_FRAME``; messages
with larger parts (a weight, a graph body, a step's outputs) travel cut into
pieces and come back whole."""
import asyncio

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from tessera_actors.runtime.actor import Actor
from tessera_actors.runtime.errors import CodecError
from tessera_actors.runtime.messages import Ping, Pong
from transport import auth, codec, wire
from transport.shm import ShmConfig
from transport.system import ActorSystem

NO_SHM = ShmConfig(enabled=False)   # frames over ZeroMQ only, as between hosts


@pytest.fixture
async def pair():
    async with ActorSystem("server", shm=NO_SHM) as server, ActorSystem("client", shm=NO_SHM) as client:
        await server.spawn(Actor(), "echo")   # every actor answers Ping with Pong of the same payload
        yield server, client, await server.listen()


async def test_a_message_with_parts_above_the_frame_limit_travels_both_ways(pair):
    _, client, address = pair
    ref = await client.remote_ref(address, "echo")
    weight = torch.randn(5 * wire.PIECE_BYTES // 4 + 3)          # 5 pieces and a bit, a LoadValues weight
    graph = bytes(range(256)) * (wire.PIECE_BYTES // 128)        # a body of two pieces, an InstallPlan graph
    payload = [weight, graph, torch.arange(7)]
    back = await ref.ask(Ping(payload), timeout=60)
    assert isinstance(back, Pong)
    assert torch.equal(back.payload[0], weight) and back.payload[1] == graph
    assert torch.equal(back.payload[2], torch.arange(7))
    back.payload[0].add_(1)   # the joined tensor is memory of its own, writable


async def test_a_frame_above_the_limit_disconnects_the_sender_and_others_go_on(pair):
    server, client, address = pair
    ctx = zmq.asyncio.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.linger = 0
    auth.secure_client(rogue, server.keys)   # authenticated: the limit is the socket's, not the handshake's
    monitor = rogue.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    rogue.connect(address)
    try:
        frames = codec.encode(Ping(torch.zeros(wire.MAX_WIRE_FRAME + 1, dtype=torch.uint8)),
                              codec.Envelope(codec.OP_ASK, 1, "echo"))
        await rogue.send_multipart(frames)   # one frame of its own over the limit, not split
        events = []
        while zmq.EVENT_DISCONNECTED not in events:
            events.append((await asyncio.wait_for(recv_monitor_message(monitor), 30))["event"])
        assert events[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED   # connected, then dropped for the frame
        assert not await rogue.poll(200)                    # and never answered
    finally:
        rogue.disable_monitor()
        monitor.close()
        rogue.close()
        ctx.term()
    ref = await client.remote_ref(address, "echo")
    assert await ref.ask(Ping(b"still there"), timeout=10) == Pong(b"still there")


def test_split_leaves_small_messages_alone_and_join_checks_the_table():
    small = codec.encode(Ping(torch.zeros(wire.PIECE_BYTES, dtype=torch.uint8)))
    assert wire.split(small) is small
    big = wire.split(codec.encode(Ping(torch.zeros(wire.PIECE_BYTES + 1, dtype=torch.uint8))))
    assert len(big) == 5 and max(len(memoryview(f)) for f in big) <= wire.PIECE_BYTES
    with pytest.raises(CodecError, match="exceeds the limit"):
        wire.join(big, max_frame=wire.PIECE_BYTES, max_body=1 << 20)
    for bad_table in ([[2, 5]], [[1, 2]], [[0, 2]], "x", []):
        with pytest.raises(CodecError):
            wire.join([*big[:-1], msgpack.packb(bad_table)], codec.DEFAULT_MAX_FRAME, codec.DEFAULT_MAX_BODY)
