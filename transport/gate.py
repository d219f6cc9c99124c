"""How many connections a listening socket holds, and for how long unproven.

ZeroMQ has no limit on the connections a ROUTER accepts, and a connection
that has not passed the security handshake can make the node hold up to
one frame (``transport.wire.MAX_WIRE_FRAME``) until the handshake times
out.  ``ConnectionGate`` counts a server's connections from its socket
monitor (accepted, disconnected, closed, by file descriptor) and tells
*proven* ones - a connection that delivered a message, which ZeroMQ does
only after the handshake - from unproven ones.  Beyond
``max_unproven`` unproven connections the oldest is shut down (a live peer
proves itself in milliseconds; a flood pushes out its own connections
first); beyond ``max_connections`` in all, the newest is.  So what
unauthenticated peers can make a node hold is bounded by
``max_unproven * MAX_WIRE_FRAME`` plus ZeroMQ's few kilobytes per connection.

A connection is shut down (``shutdown(2)`` on a duplicate of its
descriptor, never closing ZeroMQ's own) only after checking that the
descriptor still holds the same connection (local and peer address);
ZeroMQ then closes it as for any peer that went away.  Loop thread only.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import resource
import socket
from collections import OrderedDict

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("tessera_actors.transport")

_EVENTS = int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
_FD_RESERVE = 256   # descriptors kept for everything else a node opens (files, links, its own peers)


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """``max_unproven``: connections not yet past the security handshake
    (each may hold one frame); ``max_connections``: all of them, also
    capped below the process's descriptor limit."""
    max_unproven: int = 8
    max_connections: int = 4096

    def __post_init__(self):
        if self.max_unproven < 1 or self.max_connections < self.max_unproven:
            raise ValueError(f"bad connection limits {self}")

    def connections_allowed(self) -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(self.max_unproven, min(self.max_connections, soft - _FD_RESERVE))


class ConnectionGate:
    """The connections of one listening socket (see the module docstring).
    ``start`` after bind; ``saw(identity_frame)`` for each message of a
    sender not in ``senders`` yet; ``close`` before the socket closes."""

    def __init__(self, sock: zmq.Socket, limits: ConnectionLimits | None = None):
        self._sock = sock
        self.limits = limits or ConnectionLimits()
        self._allowed = self.limits.connections_allowed()
        self._unproven: OrderedDict[int, tuple] = OrderedDict()   # fd -> (local, peer) address, oldest first
        self._proven: dict[int, tuple] = {}
        self.senders: dict[bytes, int] = {}   # routing id -> the descriptor its first message came from
        self.shut = 0                          # connections this gate shut down
        self._chan = None
        self._local: tuple | None = None

    def start(self) -> None:
        from transport.channel import Channel
        monitor = self._sock.get_monitor_socket(_EVENTS)
        monitor.setsockopt(zmq.RCVHWM, 0)   # a flood's events must not be dropped
        self._chan = Channel(monitor, self._on_event)

    @property
    def connections(self) -> int:
        return len(self._unproven) + len(self._proven)

    @property
    def unproven(self) -> int:
        return len(self._unproven)

    def saw(self, identity) -> None:
        """A message arrived from the sender ``identity`` (a ``zmq.Frame``):
        its connection passed the handshake."""
        if len(self.senders) > 2 * self._allowed:   # missed disconnects: forget, senders prove themselves again
            self.senders.clear()
        try:
            fd = identity.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        self.senders[identity.bytes] = fd
        addresses = self._unproven.pop(fd, None)
        if addresses is None:   # its message came before the monitor's event, or the gate missed it
            addresses = _addresses(fd)
        if addresses is not None:
            self._proven[fd] = addresses

    def _on_event(self, frames: list) -> None:
        try:
            event = parse_monitor_message([getattr(f, "bytes", f) for f in frames])
        except (ValueError, IndexError, KeyError):
            return
        fd = int(event["value"])
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._accepted(fd)
        else:
            self._gone(fd)

    def _accepted(self, fd: int) -> None:
        addresses = _addresses(fd)
        if addresses is None:
            return   # already closed again
        if self._proven.get(fd) == addresses:
            return   # proven by its first message before this event came
        self._proven.pop(fd, None)
        self._unproven[fd] = addresses
        while len(self._unproven) > self.limits.max_unproven:
            self._shut(*self._unproven.popitem(last=False))
        if self.connections > self._allowed:
            self._shut(fd, self._unproven.pop(fd, addresses))

    def _gone(self, fd: int) -> None:
        for table in (self._unproven, self._proven):
            addresses = table.get(fd)
            if addresses is not None and _addresses(fd) != addresses:   # (equal: the event is of an earlier one)
                del table[fd]

    def _shut(self, fd: int, addresses: tuple) -> None:
        """Shut down the connection on ``fd`` if it still is the one seen."""
        try:
            dup = os.dup(fd)
        except OSError:
            return
        try:
            with socket.socket(fileno=dup) as s:
                if (s.getsockname(), s.getpeername()) == addresses:
                    s.shutdown(socket.SHUT_RDWR)
                    self.shut += 1
                    if self.shut <= 10 or self.shut % 1000 == 0:
                        log.warning("connection from %s shut down: over the limit of %d unproven / %d connections "
                                    "(%d so far)", addresses[1], self.limits.max_unproven, self._allowed, self.shut)
        except OSError:
            pass

    def close(self) -> None:
        from transport.channel import close_monitor
        close_monitor(self._sock, self._chan)


def _addresses(fd: int) -> tuple | None:
    """``(local, peer)`` address of the TCP or IPC connection on ``fd``, or
    None (closed, or not a connected socket); ZeroMQ's descriptor is only read."""
    s = _dup(fd)
    if s is None:
        return None
    try:
        with s:
            return s.getsockname(), s.getpeername()
    except OSError:
        return None


def _dup(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` open), or None."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:   # not a socket (any more)
        os.close(dup)
        return None
