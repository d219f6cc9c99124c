"""Memory before authentication: a raw TCP client without keys speaks just
enough ZMTP (a greeting naming CURVE) to reach the node's frame decoder, then
declares a huge frame and streams bytes into it, or opens many connections
that each stream a frame just under the limit.  The node's RSS stays bounded
and it keeps answering its authenticated peers."""
import asyncio
import select
import socket
import struct
import time

import pytest

from tessera_actors.runtime.messages import Ping, Pong
from tessera_actors.serving.launch import rss_bytes

MiB = 1 << 20
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31
LONG_MESSAGE = 0x02   # ZMTP frame flags: a message frame with an 8-byte size


def attacker(host: str, port: int) -> socket.socket:
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(GREETING)
    return s


def stream(s: socket.socket, declared: int, nbytes: int) -> int:
    """Declare a frame of ``declared`` bytes and send up to ``nbytes`` of it;
    returns how many went out before the node hung up."""
    sent, block = 0, b"\xab" * MiB
    try:
        s.sendall(bytes([LONG_MESSAGE]) + struct.pack("!Q", declared))
        while sent < nbytes:
            s.sendall(block[:nbytes - sent])
            sent += min(len(block), nbytes - sent)
    except OSError:   # reset by the node
        pass
    return sent


def hung_up(socks: list, want: int, timeout: float) -> int:
    """Wait (up to ``timeout`` s) until ``want`` of ``socks`` see the node close them; returns how many did."""
    deadline = time.monotonic() + timeout
    closed: set = set()
    while len(closed) < want:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([s for s in socks if s not in closed], [], [], left)
        for s in ready:
            try:
                if not s.recv(65536):
                    closed.add(s)
            except OSError:
                closed.add(s)
    return len(closed)


@pytest.fixture
async def node(warm_node):
    _, n, ref = warm_node
    host, port = n.endpoint[len("tcp://"):].rsplit(":", 1)
    return ref, n.proc.pid, host, int(port)


async def test_a_frame_declaring_1_gib_before_the_handshake_costs_the_node_nothing(node):
    ref, pid, host, port = node
    before = rss_bytes(pid)
    with attacker(host, port) as s:
        sent = await asyncio.to_thread(stream, s, 1 << 30, 256 * MiB)
        grown = rss_bytes(pid) - before
        assert await ref.ask(Ping(b"alive"), timeout=10) == Pong(b"alive")
    assert grown < 64 * MiB, f"RSS grew {grown / MiB:.0f} MiB after {sent / MiB:.0f} MiB streamed"
    assert sent < 256 * MiB   # refused at the frame header: the node hung up


async def test_many_connections_streaming_frames_under_the_limit_hold_a_bounded_amount(node):
    """64 connections each stream a 4 MiB frame (under the frame limit): all
    but ``ConnectionLimits.max_unproven`` of them are shut down, so the node
    holds at most that many frames."""
    from transport import wire
    from transport.gate import ConnectionLimits
    ref, pid, host, port = node
    before = rss_bytes(pid)
    socks = []
    try:
        for _ in range(64):
            s = attacker(host, port)
            s.setblocking(False)
            try:
                s.send(bytes([LONG_MESSAGE]) + struct.pack("!Q", wire.PIECE_BYTES) + b"\xab" * wire.PIECE_BYTES)
            except OSError:
                pass
            socks.append(s)
        keep = ConnectionLimits().max_unproven
        shut = await asyncio.to_thread(hung_up, socks, len(socks) - keep, 30)
        grown = rss_bytes(pid) - before
        assert await ref.ask(Ping(b"alive"), timeout=10) == Pong(b"alive")
    finally:
        for s in socks:
            s.close()
    assert shut >= len(socks) - keep
    assert grown < keep * wire.MAX_WIRE_FRAME + 32 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
