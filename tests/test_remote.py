"""Remote refs behave like local ones: over tcp loopback within one process,
and against an actor hosted by a child process."""
import asyncio
import os
import subprocess
import sys

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.runtime.errors import ActorDead, AskTimeout, CodecError, RemoteError, UnknownMessage
from tessera_actors.runtime.messages import ErrorReply, Ping, Pong, message
from transport.system import ActorSystem
from transport import auth, codec
from transport.codec import OP_ASK, OP_FAILED, OP_REPLY, Envelope
from remote_peer import RemoteSum, RemoteSummed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@message
class RemoteFail:
    text: str = ""


@message
class RemoteWait:
    """``block``: answered once the test opens the actor's gate (a busy handler)."""
    block: bool = False


@message
class RemoteUnhandled:
    pass


@message
class RemoteBadReply:
    pass


class Summer(Actor):
    async def on_start(self):
        self.calls = 0
        self.waiting = asyncio.Event()   # a RemoteWait is being handled
        self.gate = asyncio.Event()

    @handler(RemoteSum)
    def sum(self, msg):
        self.calls += 1
        return RemoteSummed(float(msg.tensor.float().sum()), msg.tensor)

    @handler(RemoteFail)
    def fail(self, msg):
        raise KeyError(msg.text)

    @handler(RemoteWait)
    async def wait(self, msg):
        self.waiting.set()
        if msg.block:
            await self.gate.wait()
        return self.calls

    @handler(RemoteBadReply)
    def bad_reply(self, msg):
        return object()


@pytest.fixture
async def pair():
    async with ActorSystem("server") as server, ActorSystem("client") as client:
        server.summer = Summer()   # the tests look at its state, as a user's test would
        await server.spawn(server.summer, "summer")
        address = await server.listen()
        yield server, client, address


async def test_remote_ask_with_tensors(pair):
    server, client, address = pair
    ref = await client.remote_ref(address, "summer")
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()
    reply = await ref.ask(RemoteSum(t))
    assert reply.total == float(t.float().sum())
    assert reply.echo.dtype == torch.bfloat16 and torch.equal(reply.echo, t)
    assert await ref.ask(Ping(b"x")) == Pong(b"x")
    await ref.tell(RemoteSum(torch.ones(2)))
    assert await ref.ask(RemoteWait()) == 2   # the tell was handled first


async def test_remote_errors_match_local(pair):
    server, client, address = pair
    ref = await client.remote_ref(address, "summer")
    with pytest.raises(UnknownMessage, match="RemoteUnhandled"):
        await ref.ask(RemoteUnhandled())
    with pytest.raises(RemoteError) as info:
        await ref.ask(RemoteFail("missing"))
    assert info.value.kind == "KeyError" and "missing" in info.value.message
    with pytest.raises(CodecError, match="not encodable"):
        await ref.ask(RemoteBadReply())
    assert (await ref.ask(RemoteSum(torch.ones(3)))).total == 3.0   # still serving


async def test_remote_unknown_name_is_actor_dead(pair):
    server, client, address = pair
    ref = await client.remote_ref(address, "nobody")
    with pytest.raises(ActorDead):
        await ref.ask(Ping())
    assert not ref.alive


async def test_remote_timeout_leaves_no_pending_entry(pair):
    server, client, address = pair
    ref = await client.remote_ref(address, "summer")
    with pytest.raises(AskTimeout):
        await ref.ask(RemoteWait(block=True), timeout=0.05)
    assert ref._peer.pending == 0
    server.summer.gate.set()                 # the handler answers now, late: the answer comes before the Pong
    assert await ref.ask(Ping()) == Pong()   # the late answer was dropped


async def test_unreachable_peer_times_out():
    async with ActorSystem("client") as client:
        with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as probe:
            port = probe.bind_to_random_port("tcp://127.0.0.1")
        ref = await client.remote_ref(f"tcp://127.0.0.1:{port}", "x")   # nobody listens there now
        with pytest.raises(AskTimeout):
            await ref.ask(Ping(), timeout=0.1)
        assert ref._peer.pending == 0


async def blocked_ask(pair, timeout: float = 10.0):
    """(the client's ref to the summer, its pending ``RemoteWait`` ask) once
    the server's handler is inside the ask, blocked on its gate."""
    server, client, address = pair
    ref = await client.remote_ref(address, "summer")
    pending = asyncio.ensure_future(ref.ask(RemoteWait(block=True), timeout=timeout))
    await asyncio.wait_for(server.summer.waiting.wait(), 10)
    return ref, pending


async def test_remote_stop_and_pending_asks(pair):
    server, client, address = pair
    ref, pending = await blocked_ask(pair)
    await ref.stop()
    with pytest.raises(ActorDead):
        await pending
    assert "summer" not in server.actors() and not ref.alive
    again = await client.remote_ref(address, "summer")
    with pytest.raises(ActorDead):
        await again.ask(Ping())


async def test_client_shutdown_fails_pending_remote_asks(pair):
    client = pair[1]
    _, pending = await blocked_ask(pair)
    await client.shutdown()
    with pytest.raises(ActorDead):
        await pending


async def test_server_shutdown_answers_pending_remote_asks_with_actor_dead(pair):
    server = pair[0]
    _, pending = await blocked_ask(pair, timeout=5)
    await server.shutdown()
    with pytest.raises(ActorDead):
        await asyncio.wait_for(pending, 2)


@message
class RemoteCount:
    n: int = 0


class SlowCounter(Actor):
    mailbox_size = 2

    async def on_start(self):
        self.seen = []

    @handler(RemoteCount)
    async def count(self, msg):
        await asyncio.sleep(0.001)   # a slow consumer (the behaviour under test): its 2-slot mailbox fills
        self.seen.append(msg.n)

    @handler(RemoteWait)
    def report(self, msg):
        return self.seen


async def test_remote_tells_to_full_mailbox_are_delivered_in_order(pair):
    server, client, address = pair
    await server.spawn(SlowCounter(), "slow")
    ref = await client.remote_ref(address, "slow")
    for n in range(50):
        await ref.tell(RemoteCount(n))
    assert await ref.ask(RemoteWait()) == list(range(50))
    assert await (await client.remote_ref(address, "summer")).ask(Ping()) == Pong()


async def test_malformed_frames_over_the_wire(pair, caplog):
    server, client, address = pair
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client(sock, auth.process_keys())   # a raw but authenticated client
    sock.connect(address)
    try:
        await sock.send_multipart([b"garbage"])                               # unreadable: logged only
        await sock.send_multipart([b"TSRA\x07\x00", b"\x90"])                 # wrong version
        body = msgpack.packb([OP_ASK, 5, "summer", "Nope", {}])
        await sock.send_multipart([codec.HEADER_BYTES, body])                 # unknown kind, readable envelope
        env, reply = codec.decode(await asyncio.wait_for(sock.recv_multipart(), 2))
        assert env == Envelope(OP_FAILED, 5, "") and reply.kind == "CodecError" and "Nope" in reply.message
        frames = codec.encode(RemoteSum(torch.ones(4)), Envelope(OP_ASK, 6, "summer"))
        frames[2] = bytes(frames[2])[:-2]                                     # truncated tensor frame
        await sock.send_multipart(frames)
        env, reply = codec.decode(await asyncio.wait_for(sock.recv_multipart(), 2))
        assert env.request_id == 6 and isinstance(reply, ErrorReply) and reply.kind == "CodecError"
        await sock.send_multipart(codec.encode(Ping(b"ok"), Envelope(OP_ASK, 7, "summer")))
        env, reply = codec.decode(await asyncio.wait_for(sock.recv_multipart(), 2))
        assert (env.op, env.request_id, reply) == (OP_REPLY, 7, Pong(b"ok"))   # server keeps working
    finally:
        sock.close()
        ctx.term()
    assert "undecodable request" in caplog.text


def test_local_and_remote_under_uvloop():
    uvloop = pytest.importorskip("uvloop")

    async def scenario():
        async with ActorSystem("server") as server, ActorSystem("client") as client:
            summer = Summer()
            local = await server.spawn(summer, "summer")
            remote = await client.remote_ref(await server.listen(), "summer")
            for ref in (local, remote):
                assert (await ref.ask(RemoteSum(torch.ones(3, dtype=torch.bfloat16)))).total == 3.0
                with pytest.raises(RemoteError):
                    await ref.ask(RemoteFail("x"))
                with pytest.raises(AskTimeout):
                    await ref.ask(RemoteWait(block=True), timeout=0.02)
                summer.gate.set()
                assert await ref.ask(Ping(), timeout=5) == Pong()   # behind the released handler
                summer.gate.clear()
            summer.waiting.clear()
            pending = asyncio.ensure_future(remote.ask(RemoteWait(block=True)))
            await asyncio.wait_for(summer.waiting.wait(), 5)
            await local.stop()
            with pytest.raises(ActorDead):
                await pending

    uvloop.run(scenario())


async def test_two_process_messaging_with_tensors():
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "remote_peer.py")],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    try:
        address = (await asyncio.to_thread(proc.stdout.readline)).strip()
        assert address.startswith("tcp://"), address
        async with ActorSystem("parent") as system:
            ref = await system.remote_ref(address, "summer")
            for t in (torch.randn(64, 33).t(), torch.arange(10, dtype=torch.int64),
                      torch.ones(5, dtype=torch.bfloat16), torch.empty(0, 3)):
                reply = await ref.ask(RemoteSum(t), timeout=10)
                # float32 sums in another order (the child's copy is contiguous): a sum near 0 differs
                # by rounding of the addends, not relative to the sum
                assert reply.total == pytest.approx(float(t.double().sum()), rel=1e-5, abs=1e-3)
                assert reply.echo.dtype == t.dtype and torch.equal(reply.echo, t * 2)
            big = torch.randn(1 << 20)
            assert torch.equal((await ref.ask(RemoteSum(big))).echo, big * 2)
    finally:
        proc.terminate()
        rc = await asyncio.to_thread(proc.wait, 5)
    assert rc == 0
