"""Large tensors to same-host peers travel through shared memory: they arrive
bitwise equal, segments are reused and removed, other hosts get ZeroMQ
frames, and malformed descriptors are answered with an error."""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.runtime.messages import ErrorReply, Ping, Pong, message
from transport.system import ActorSystem
from transport import auth, codec, shm
from transport.codec import OP_ASK, OP_FAILED, OP_RELEASE, OP_REPLY, Envelope
from transport.shm import ShmConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ShmConfig(threshold=1)   # every non-empty tensor goes through shared memory


@message
class ShmEcho:
    value: object = None


class Keeper(Actor):
    """Answers with what it received (re-sent as ZeroMQ frames) and keeps
    the last received value, as an actor holding on to a tensor would."""

    @handler(ShmEcho)
    def echo(self, msg):
        self.last = msg.value
        return ShmEcho(msg.value)


def own_segments(pid=None) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{pid or os.getpid()}-")]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
async def shm_pair():
    async with ActorSystem("server") as server, ActorSystem("client", shm=TINY) as client:
        server.keeper = Keeper()   # the tests look at what it kept
        await server.spawn(server.keeper, "keeper")
        address = await server.listen()
        ref = await client.remote_ref(address, "keeper")
        assert await ref._peer.shm_ready()
        yield server, client, ref


async def test_tensors_of_every_dtype_and_layout_round_trip_bitwise(shm_pair):
    server, client, ref = shm_pair
    random_bits = torch.randint(-2**15, 2**15, (33, 17), dtype=torch.int16)
    tensors = [
        random_bits.view(torch.bfloat16),                 # includes NaN and inf bit patterns
        random_bits.view(torch.float16).t(),              # non-contiguous
        torch.randn(8, 9, dtype=torch.float64)[:, ::2],   # strided
        torch.arange(-50, 50, dtype=torch.int8),
        torch.rand(7) > 0.5,
        torch.randn(3, 4, dtype=torch.complex64),
        torch.empty(0, 5),                                # empty: stays a (zero-byte) frame
        torch.randn(1 << 19),                             # 2 MiB
    ]
    reply = await ref.ask(ShmEcho(tensors))
    assert len(own_segments()) >= len(tensors) - 1   # the non-empty ones used segments
    for sent, back in zip(tensors, reply.value):
        assert back.dtype == sent.dtype and back.shape == sent.shape
        assert bits(back) == bits(sent)
    array = np.arange(24, dtype=">i4").reshape(4, 6)[:, 1::2]   # numpy, big-endian, strided
    back = (await ref.ask(ShmEcho(array))).value
    assert back.dtype == array.dtype and np.array_equal(back, array)


async def test_sender_may_modify_its_tensor_once_sent(shm_pair):
    server, client, ref = shm_pair
    t = torch.ones(1 << 18)
    await ref.tell(ShmEcho(t))
    t.fill_(7)   # shared memory holds a copy: the receiver keeps seeing ones
    assert await ref.ask(Ping()) == Pong()   # the tell was handled first
    assert torch.equal(server.keeper.last, torch.ones(1 << 18))


async def test_segments_are_reused_and_removed_at_shutdown():
    async with ActorSystem("server") as server:
        server.keeper = Keeper()
        await server.spawn(server.keeper, "keeper")
        address = await server.listen()
        async with ActorSystem("client", shm=ShmConfig(threshold=1, max_bytes=8 << 20)) as client:
            ref = await client.remote_ref(address, "keeper")
            assert await ref._peer.shm_ready()
            t = torch.randn(1 << 18)   # 1 MiB
            for _ in range(30):   # 30 MiB through a pool of at most 8 MiB: segments come back
                assert torch.equal((await ref.ask(ShmEcho(t))).value, t)
            assert 1 <= len(own_segments()) <= 8
            kept = server.keeper.last   # a received tensor outlives the sender's pool
        assert own_segments() == []
        assert torch.equal(kept, t)


def test_only_local_endpoints_are_candidates():
    for local in ("ipc:///tmp/x.sock", "tcp://127.0.0.1:5555", "tcp://127.1.2.3:1", "tcp://localhost:9",
                  "tcp://[::1]:7"):
        assert shm.is_local_endpoint(local), local
    for remote in ("tcp://192.0.2.2:5555", "tcp://example.org:1", "tcp://*:5", "inproc://x", "tcp://1127.0.0.1:5"):
        assert not shm.is_local_endpoint(remote), remote
    with pytest.raises(ValueError, match="threshold"):
        ShmConfig(threshold=0)


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # no packet is sent; picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_large_frame_to_a_non_local_endpoint_uses_zeromq_frames():
    host = _non_loopback_address()
    if host is None:
        pytest.skip("no non-loopback interface")
    async with ActorSystem("server") as server, ActorSystem("client", shm=TINY) as client:
        await server.spawn(Keeper(), "keeper")
        port = (await server.listen(f"tcp://{host}:0")).rsplit(":", 1)[1]
        ref = await client.remote_ref(f"tcp://{host}:{port}", "keeper")
        assert not await ref._peer.shm_ready()
        t = torch.randn(1 << 20)
        assert torch.equal((await ref.ask(ShmEcho(t))).value, t)
        assert own_segments() == []


async def test_shm_disabled_uses_zeromq_frames():
    async with ActorSystem("server") as server, ActorSystem("client", shm=ShmConfig(enabled=False)) as client:
        await server.spawn(Keeper(), "keeper")
        ref = await client.remote_ref(await server.listen(), "keeper")
        assert not await ref._peer.shm_ready()
        t = torch.randn(1 << 20)
        assert torch.equal((await ref.ask(ShmEcho(t))).value, t)
        assert own_segments() == []


async def answer(sock):
    """The next answer on a raw socket, skipping segment releases."""
    while True:
        env, value = codec.decode(await asyncio.wait_for(sock.recv_multipart(), 5))
        if env.op != OP_RELEASE:
            return env, value


async def test_malformed_descriptors_get_an_error_reply(shm_pair):
    server, client, ref = shm_pair
    pool = shm.SegmentPool(16 << 20)
    seg = pool.acquire(4096)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client(sock, auth.process_keys())   # a raw but authenticated client
    sock.connect(server.address)
    header = bytes([*codec.MAGIC, codec.PROTOCOL_VERSION, 1 | shm.FLAG_SHM])
    hello, proof = pool.probe()   # the handshake: segments of this pool only, from this connection
    await sock.send_multipart(codec.encode(hello, Envelope(codec.OP_SHM_HELLO, 100, "")))
    assert await answer(sock) == (Envelope(OP_REPLY, 100, ""), proof)
    bad_tables = [
        b"\xc1\xc1",                                                   # not msgpack
        msgpack.packb([]),                                             # empty
        msgpack.packb([[0, "../../etc/passwd", 1, 16]]),               # not a segment name
        msgpack.packb([[0, f"{shm.PREFIX}1-ab-1", 1, 16]]),            # no such segment
        msgpack.packb([[0, seg.name, seg.generation, 1 << 30]]),       # larger than the segment
        msgpack.packb([[5, seg.name, seg.generation, 16]]),            # no such frame
        msgpack.packb([[0, seg.name]]),                                # short descriptor
    ]
    try:
        for rid, table in enumerate(bad_tables, start=1):
            frames = codec.encode(ShmEcho(torch.ones(4)), Envelope(OP_ASK, rid, "keeper"))
            await sock.send_multipart([header, frames[1], b"", table])
            env, reply = await answer(sock)
            assert (env.op, env.request_id) == (OP_FAILED, rid)
            assert isinstance(reply, ErrorReply) and reply.kind == "CodecError", reply
        # a well-formed descriptor from the same raw client works
        seg.write(torch.arange(4, dtype=torch.float32).numpy().tobytes())
        frames = codec.encode(ShmEcho(torch.ones(4)), Envelope(OP_ASK, 99, "keeper"))
        await sock.send_multipart([header, frames[1], b"", msgpack.packb([[0, seg.name, seg.generation, 16]])])
        env, reply = await answer(sock)
        assert (env.op, env.request_id) == (OP_REPLY, 99)
        assert torch.equal(reply.value, torch.arange(4, dtype=torch.float32))
    finally:
        sock.close()
        ctx.term()
        pool.close()
    assert await ref.ask(Ping(b"still")) == Pong(b"still")


SENDER = textwrap.dedent("""
    import asyncio, os, signal, sys, torch
    from tessera_actors.runtime.messages import message
    from transport.system import ActorSystem
    from transport.shm import ShmConfig

    @message
    class ShmEcho:
        value: object = None

    async def main(address, mode):
        stop = asyncio.Event()
        if mode == "handler":
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with ActorSystem("sender", shm=ShmConfig(threshold=1)) as system:
            ref = await system.remote_ref(address, "keeper")
            assert await ref._peer.shm_ready()
            await ref.ask(ShmEcho(torch.ones(1 << 18)))
            print("sent", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            await stop.wait()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


@pytest.mark.parametrize("mode", ["handler", "kill"])
async def test_no_segments_left_when_the_sender_exits_or_dies(mode):
    async with ActorSystem("server") as server:
        server.keeper = Keeper()
        await server.spawn(server.keeper, "keeper")
        address = await server.listen()
        proc = subprocess.Popen([sys.executable, "-c", SENDER, address, mode], stdout=subprocess.PIPE,
                                text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
        try:
            assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "sent"
            if mode == "handler":
                assert own_segments(proc.pid)   # the sender's pool is live
                proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(proc.wait, 10)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert torch.equal(server.keeper.last, torch.ones(1 << 18))   # received memory stays valid
        if mode == "handler":
            assert rc == 0 and own_segments(proc.pid) == []
        else:
            assert rc == -signal.SIGKILL
            shm.sweep_stale()   # what the next pool created on this host does
            assert own_segments(proc.pid) == []
