"""Shared memory between a node and an authenticated but hostile local peer,
and against another user of the host: the node reads only segments that the
announcing connection's pool made for it (never another process's, and
nothing of one goes back), refuses sparse segments before a page is
touched, and a sender whose segment names are squatted still gets its
messages through."""
import asyncio
import os

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from tessera_actors.runtime.actor import Actor
from tessera_actors.runtime.messages import ErrorReply, Ping, Pong
from tessera_actors.serving.launch import rss_bytes
from transport import auth, codec, shm
from transport.codec import (
    OP_ASK,
    OP_FAILED,
    OP_RELEASE,
    OP_REPLY,
    OP_SHM_HELLO,
    Envelope,
)
from transport.system import ActorSystem

MiB = 1 << 20
SECRET = b"the victim's bytes, not yours"
SHM_HEADER = bytes([*codec.MAGIC, codec.PROTOCOL_VERSION, 1 | shm.FLAG_SHM])


@pytest.fixture
async def node(warm_node):
    system, n, ref = warm_node
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    auth.secure_client(sock, system.keys)   # authenticated, but hostile
    sock.connect(n.endpoint)
    try:
        yield ref, n.proc.pid, sock
    finally:
        sock.close()
        ctx.term()


async def until_answer(sock, rid: int) -> tuple[list, Envelope, object]:
    """Every message up to the answer to ``rid``: (their raw bytes, its envelope, its value)."""
    seen = []
    while True:
        frames = await asyncio.wait_for(sock.recv_multipart(), 30)
        seen.append(b"".join(frames))
        env, value = codec.decode(frames)
        if env.op != OP_RELEASE and env.request_id == rid:
            return seen, env, value


def described(nbytes: int, name: str, generation: int, rid: int) -> list:
    """A Ping whose payload of ``nbytes`` is said to be in segment ``name``
    (the tensor is never allocated: only its descriptor travels)."""
    body = codec.encode(Ping(torch.empty(nbytes, dtype=torch.uint8)), Envelope(OP_ASK, rid, "node"))[1]
    return [SHM_HEADER, body, b"", msgpack.packb([[0, name, generation, nbytes]])]


async def test_a_hello_or_descriptor_naming_another_process_s_segment_is_refused_and_nothing_echoed(node):
    ref, _, sock = node
    victim = shm.SegmentPool(16 * MiB)   # another connection's pool, of the node's own user
    own = shm.SegmentPool(16 * MiB)
    try:
        seg = victim.acquire(4096)
        seg.write(SECRET * 100)
        # the hellos of the issue: the victim's segment as the probe (old and new spellings)
        for rid, hello in enumerate([[seg.name], [seg.name, os.urandom(shm.SECRET_BYTES)]], start=1):
            await sock.send_multipart(codec.encode(hello, Envelope(OP_SHM_HELLO, rid, "")))
            seen, env, reply = await until_answer(sock, rid)
            assert env.op == OP_FAILED and isinstance(reply, ErrorReply), reply
            assert not any(SECRET[:16] in raw for raw in seen)
        # a hello of its own pool is fine; a descriptor of the victim's segment on that connection is not
        hello, proof = own.probe()
        await sock.send_multipart(codec.encode(hello, Envelope(OP_SHM_HELLO, 3, "")))
        assert (await until_answer(sock, 3))[1:] == (Envelope(OP_REPLY, 3, ""), proof)
        await sock.send_multipart(described(len(SECRET), seg.name, seg.generation, 4))
        seen, env, reply = await until_answer(sock, 4)
        assert env.op == OP_FAILED and "not made for this connection" in reply.message
        assert len(seen) == 1 and SECRET not in seen[0]   # the refusal only: no bytes, no release of it
    finally:
        victim.close()
        own.close()
    assert await ref.ask(Ping(b"alive"), timeout=10) == Pong(b"alive")


@pytest.mark.parametrize("size", [1 << 30, 2 << 30])
async def test_a_sparse_segment_is_refused_before_its_pages_are_touched(node, size):
    ref, pid, sock = node
    pool = shm.SegmentPool(16 * MiB)
    try:
        hello, proof = pool.probe()
        await sock.send_multipart(codec.encode(hello, Envelope(OP_SHM_HELLO, 1, "")))
        assert (await until_answer(sock, 1))[1:] == (Envelope(OP_REPLY, 1, ""), proof)
        seg = pool.acquire(4096)
        os.ftruncate(seg.fd, size)   # a named, owned, large enough - and empty - segment
        before = rss_bytes(pid)
        await sock.send_multipart(described(size, seg.name, seg.generation, 2))
        _, env, reply = await until_answer(sock, 2)
        grown = rss_bytes(pid) - before
    finally:
        pool.close()
    assert env.op == OP_FAILED and "sparse" in reply.message, reply
    assert grown < 64 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
    assert await ref.ask(Ping(b"alive"), timeout=10) == Pong(b"alive")


def squat(name: str) -> str:
    """Create ``name`` in /dev/shm as another user (uid 65534), before its sender does."""
    fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.fchown(fd, 65534, 65534)
    os.close(fd)
    return name


def predicted(names: list[str], ahead: int) -> set[str]:
    """What another user guesses from the names it sees in /dev/shm: each
    number in a name (but the pid) counted on by up to ``ahead``."""
    out = set()
    for name in names:
        parts = name.split("-")
        for i in range(2, len(parts)):
            if parts[i].isdigit():
                out |= {"-".join(parts[:i] + [str(int(parts[i]) + k)] + parts[i + 1:]) for k in range(1, ahead + 1)}
    return out - set(os.listdir(shm.SHM_DIR))


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs root")
async def test_squatted_segment_names_cannot_stop_a_sender():
    made = []
    try:
        async with ActorSystem("server") as server, ActorSystem("client") as client:
            await server.spawn(Actor(), "echo")
            ref = await client.remote_ref(await server.listen(), "echo")
            assert await ref._peer.shm_ready()
            first = torch.randn(MiB // 2)   # 2 MiB: a segment of the pool
            assert torch.equal((await ref.ask(Ping(first), timeout=30)).payload, first)
            mine = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{os.getpid()}-")]
            made += [squat(n) for n in predicted(mine, 32)]
            for mib in (8, 16):   # larger each time: new segments, under new names
                t = torch.randn(mib * MiB // 4)
                assert torch.equal((await ref.ask(Ping(t), timeout=30)).payload, t)
            pool = ref._peer._shm_pool   # now every name the pool would try next is taken
            made += [squat(pool.name(pool._count + k)) for k in range(1, 9)]
            for mib in (32, 64):   # the first goes over ZeroMQ, the second gets a segment past the squatted names
                t = torch.randn(mib * MiB // 4)
                assert torch.equal((await ref.ask(Ping(t), timeout=60)).payload, t)
            assert pool.collisions >= 8
            assert max(seg.size for seg in pool._segments.values()) >= 64 * MiB
    finally:
        for name in made:
            os.unlink(os.path.join(shm.SHM_DIR, name))
