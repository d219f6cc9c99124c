"""ZeroMQ endpoints: a ROUTER that serves local actors, a DEALER per peer.

``Server`` binds a ROUTER socket; each request is decoded and put into the
named local actor's mailbox, and the answer is sent from the answer future's
callback, so receiving never waits for a handler.  ``Peer`` owns one DEALER
connected to a remote system and resolves pending asks by request id.
``RemoteRef`` gives a remote actor the ``ActorRef`` interface.

Nothing here blocks the event loop: sockets are driven by ``Channel``
(loop reader on the ZeroMQ FD; works under uvloop), frames go out with
``copy=False`` (tensor frames are not copied), sockets close with linger 0.
Requests that are not light (``transport.guard``) are decoded on a guard
thread, each sender's requests kept in order, so no request holds the loop
for long.  A request that does not decode is logged and, when its envelope is readable
and it was an ask, answered with ``ErrorReply(kind="CodecError")``; bad input
never stops a socket.

Backpressure: a remote tell or ask to a full mailbox pauses that server's
receiving until space frees (per-socket order is kept); ZeroMQ's high-water
mark then makes remote senders wait.  Limits (before any authentication):
frames and handshakes per socket (``transport.wire``; larger message parts
are split on send and joined on receipt here), connections per server
(``transport.gate``).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from typing import Any, Callable

import zmq

from tessera_actors.runtime.actor import ActorRef, LocalRef
from tessera_actors.runtime.errors import (RUNTIME_ERRORS, ActorDead, ActorError, AskTimeout, CodecError,
                                   MailboxFull, RemoteError)
from tessera_actors.runtime.messages import ErrorReply, Ok
from transport import auth, codec, guard, shm, shm_frames, wire
from transport.channel import Channel
from transport.codec import (OP_ASK, OP_FAILED, OP_RAISED, OP_RELEASE, OP_REPLY, OP_SHM_HELLO, OP_STOP, OP_TELL,
                             Envelope)
from transport.gate import ConnectionGate, ConnectionLimits
from transport.shm import ShmConfig

log = logging.getLogger("tessera_actors.transport")

# Envelope((op, request_id, target)) without NamedTuple's Python-level __new__ (hot path)
_envelope = functools.partial(tuple.__new__, Envelope)


class Server:
    """ROUTER endpoint serving the local actors that ``resolve(name)`` finds."""

    def __init__(self, ctx: zmq.Context, resolve: Callable[[str], LocalRef | None], *,
                 max_frame: int = codec.DEFAULT_MAX_FRAME, max_body: int = codec.DEFAULT_MAX_BODY,
                 shm_config: ShmConfig | None = None, keys: auth.ClusterKeys | None = None,
                 limits: ConnectionLimits | None = None):
        """``keys``: serve only clients the cluster keys allow (None: anyone;
        then shared memory is off, as it is only for authenticated peers);
        ``limits``: how many connections, proven and not (``transport.gate``)."""
        self._sock = wire.socket(ctx, zmq.ROUTER)
        if keys is not None:
            auth.secure_server(self._sock, keys)
        self.gate = ConnectionGate(self._sock, limits)
        self._resolve = resolve
        self._max_frame, self._max_body = max_frame, max_body
        self._chan: Channel | None = None
        self._tasks: set[asyncio.Task] = set()
        self.address = ""
        self.undecodable = 0   # requests that did not decode (logged: the first 20, then every 1000th)
        self._guard: guard.Guard | None = None   # decodes heavy requests off the loop (made at bind)
        shm_config = shm_config or ShmConfig()   # (tensors local peers put in shared memory; answers use frames)
        self._shm = (shm.SegmentReader(self._send_releases, asyncio.get_running_loop())
                     if shm_config.enabled and keys is not None and shm.shm_available() else None)

    def bind(self, endpoint: str) -> str:
        """Bind (non-blocking) and start serving; returns the resolved address."""
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            endpoint = endpoint[:-1] + "*"   # ZeroMQ's spelling of "any free port"
        self._sock.bind(endpoint)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._guard = guard.Guard(self._decode, self._serve, lambda: self._chan.pause(), lambda: self._chan.resume())
        self._chan = Channel(self._sock, self._receive)
        self.gate.start()
        return self.address

    def _receive(self, frames: list) -> None:
        if frames[0].bytes not in self.gate.senders:
            self.gate.saw(frames[0])
        self._guard.receive(frames)

    def _decode(self, payload: list, identity) -> tuple | CodecError:
        """``(envelope, message)``, or the ``CodecError`` (any thread)."""
        try:
            return guard.decode_request(payload, self._shm, identity.bytes, self._max_frame, self._max_body)
        except CodecError as exc:
            return exc

    def _serve(self, identity, payload: list, decoded) -> None:
        if isinstance(decoded, CodecError):
            env = codec.decode_envelope(payload)
            self.undecodable += 1
            if self.undecodable <= 20 or self.undecodable % 1000 == 0:   # a flood must not flood the log
                log.warning("undecodable request on %s (%s): %s (%d so far)", self.address, env, decoded,
                            self.undecodable)
            if env is not None and env.op in (OP_ASK, OP_STOP) and env.request_id:
                self._send_answer(identity, env.request_id, OP_FAILED, ErrorReply("CodecError", str(decoded)))
            return
        env, msg = decoded
        op, request_id, target = env
        ref = self._resolve(target)
        if op == OP_ASK:
            if ref is None:
                self._send_answer(identity, request_id, OP_FAILED,
                                  ErrorReply("NoSuchActor", f"no actor named {target!r}"))
                return
            answer = _Answer(self, identity, request_id)
            if ref._dead or not ref._offer((msg, answer)):   # (the common case inlined)
                self._deliver(ref, msg, answer)
        elif op == OP_TELL:
            if ref is None:
                log.warning("tell to unknown actor %r dropped", env.target)
                return
            self._deliver(ref, msg, None)
        elif op == OP_STOP:
            self._spawn(self._stop(identity, env.request_id, ref))
        elif op == OP_SHM_HELLO:
            self._spawn(self._shm_hello(identity, env.request_id, msg))
        else:
            log.warning("unknown op %d on %s", op, self.address)
            if env.request_id:
                self._send_answer(identity, env.request_id, OP_FAILED,
                                  ErrorReply("CodecError", f"unknown op {op}"))

    async def _shm_hello(self, identity, request_id: int, hello: Any) -> None:
        """Handshake: answer with the proof of the nonce in the peer's probe
        segment (on the guard thread: the reader's segments are only touched there)."""
        try:
            if self._shm is None:
                raise CodecError("shared memory is off on this side")
            proof = await self._guard.run(self._shm.read_probe, getattr(identity, "bytes", identity), hello)
        except (CodecError, OSError, ValueError) as exc:
            self._send_answer(identity, request_id, OP_FAILED, ErrorReply("ShmUnavailable", str(exc)))
            return
        self._send_answer(identity, request_id, OP_REPLY, proof)

    def _send_releases(self, identity: bytes, tokens: list) -> None:
        if self._chan is not None and not self._chan.closed:
            self._chan.send([identity, *codec.encode([list(t) for t in tokens], Envelope(OP_RELEASE))])

    def _deliver(self, ref: LocalRef, msg: Any, fut: asyncio.Future | None) -> None:
        try:
            if ref.try_deliver(msg, fut):
                return
        except ActorDead as exc:
            self._dead_letter(ref, fut, exc)
            return
        self._chan.pause()   # mailbox full: stop receiving until it takes this message
        self._spawn(self._deliver_when_space(ref, msg, fut))

    async def _deliver_when_space(self, ref: LocalRef, msg: Any, fut) -> None:
        try:
            await ref.deliver(msg, fut)
        except ActorDead as exc:
            self._dead_letter(ref, fut, exc)
        finally:
            if self._chan is not None:
                self._chan.resume()

    def _dead_letter(self, ref: LocalRef, fut, exc: ActorDead) -> None:
        if fut is None:
            log.warning("tell to stopped actor %r dropped", ref.name)
        elif not fut.done():
            fut.set_exception(exc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop(self, identity, request_id: int, ref: LocalRef | None) -> None:
        if ref is not None:
            await ref.stop()
        self._send_answer(identity, request_id, OP_REPLY, Ok("stopped"))

    def _send_answer(self, identity, request_id: int, op: int, value: Any) -> None:
        if self._chan is None or self._chan.closed:
            return
        try:
            frames = codec.encode(value, _envelope((op, request_id, "")))
        except CodecError as exc:
            frames = codec.encode(ErrorReply("CodecError", f"reply not encodable: {exc}"),
                                  Envelope(OP_FAILED, request_id))
        try:
            self._chan.send([identity, *wire.split(frames)])   # ROUTER never blocks: drops if the peer is gone
        except zmq.ZMQError as exc:
            log.warning("answer on %s failed: %s", self.address, exc)

    def close(self) -> None:
        """Stop serving and close the socket (linger 0); idempotent."""
        for task in self._tasks:
            task.cancel()
        if self._guard is not None:
            self._guard.close()
        self.gate.close()
        if self._shm is not None:
            self._shm.close()
        if self._chan is not None:
            self._chan.close()
        else:
            self._sock.close(linger=0)


class _Answer:
    """Future-like answer slot for a remote ask, put in a local mailbox.

    The actor calls ``set_result``/``set_exception`` as on a future; the
    answer is encoded and sent at once (no extra event-loop hop)."""

    __slots__ = ("_server", "_identity", "_request_id", "_done")

    def __init__(self, server: Server, identity, request_id: int):
        self._server, self._identity, self._request_id = server, identity, request_id
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        if self._done:
            raise asyncio.InvalidStateError("answer already sent")
        self._done = True
        self._server._send_answer(self._identity, self._request_id, OP_REPLY, value)

    def set_exception(self, exc: BaseException) -> None:
        if isinstance(exc, RemoteError):
            self._finish(OP_RAISED, ErrorReply(exc.kind, exc.message))
        elif isinstance(exc, ActorError):
            self._finish(OP_FAILED, ErrorReply(type(exc).__name__, str(exc)))
        else:
            self._finish(OP_RAISED, ErrorReply(type(exc).__name__, str(exc)))

    def _finish(self, op: int, value: Any) -> None:
        if self._done:
            raise asyncio.InvalidStateError("answer already sent")
        self._done = True
        self._server._send_answer(self._identity, self._request_id, op, value)


class Peer:
    """DEALER connection to one remote system; shared by all refs to it."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *,
                 max_frame: int = codec.DEFAULT_MAX_FRAME, max_body: int = codec.DEFAULT_MAX_BODY,
                 shm_config: ShmConfig | None = None, keys: auth.ClusterKeys | None = None):
        self.endpoint = endpoint
        sock = wire.socket(ctx, zmq.DEALER)
        if keys is not None:
            auth.secure_client(sock, keys)
        self._watch = auth.HandshakeWatch(sock, self._handshake_failed)
        sock.connect(endpoint)
        self._max_frame, self._max_body = max_frame, max_body
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._loop = asyncio.get_running_loop()
        self._chan = Channel(sock, self._on_answer)
        self._shm_config = shm_config = shm_config or ShmConfig()
        self._shm_pool: shm.SegmentPool | None = None   # set once the handshake proved a shared host
        self._shm_handshake: asyncio.Task | None = None
        self._hello_rid = 0
        if shm_config.enabled and shm.is_local_endpoint(endpoint) and shm.shm_available():
            self._shm_handshake = self._loop.create_task(self._handshake())

    def _handshake_failed(self, reason: str, first: bool) -> None:
        """The server refused us: fail the pending asks now instead of at their timeouts."""
        if first:   # ZeroMQ retries every 100 ms: log once per refusal streak
            log.warning("connection to %s: %s", self.endpoint, reason)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(auth.HandshakeFailed(f"{self.endpoint}: {reason}"))

    async def _handshake(self, timeout: float = 10.0) -> None:
        """Prove the server sees our segments: it must answer the proof of a
        nonce we wrote into a probe segment.  Until then (or if not) frames go over ZeroMQ."""
        pool = shm.SegmentPool(self._shm_config.max_bytes)
        try:
            hello, proof = pool.probe()
            try:
                self._hello_rid = next(self._ids)
                seen = await self.request(OP_SHM_HELLO, "", hello, timeout, self._hello_rid)
            finally:
                pool.discard(hello[0])
            if seen != proof and not self.closed:
                raise OSError("the peer read another nonce")
        except (ActorError, OSError) as exc:
            log.info("shared memory to %s not used: %s", self.endpoint, exc)
            pool.close()
            return
        except BaseException:
            pool.close()
            raise
        if self.closed:
            pool.close()
        else:
            self._shm_pool = pool

    async def shm_ready(self) -> bool:
        """Wait for the shared-memory handshake; True when large tensor frames
        to this peer now travel through shared memory."""
        if self._shm_handshake is not None:
            await asyncio.wait([self._shm_handshake])
        return self._shm_pool is not None

    def _frames(self, msg: Any, envelope: Envelope) -> tuple[list, list]:
        frames, tokens = codec.encode(msg, envelope), ()
        if self._shm_pool is not None and len(frames) > 2:
            frames, tokens = shm_frames.to_shm(frames, self._shm_pool, self._shm_config.threshold)
        return wire.split(frames), tokens

    def _unsent(self, tokens) -> None:
        """A message was dropped before ZeroMQ took it: free its segments."""
        if self._shm_pool is not None:
            for name, generation in tokens:
                self._shm_pool.release(name, generation)

    @property
    def closed(self) -> bool:
        return self._chan.closed

    @property
    def pending(self) -> int:
        """Asks awaiting an answer (for leak checks; not the shared-memory handshake)."""
        return len(self._pending) - (self._hello_rid in self._pending)

    async def request(self, op: int, target: str, msg: Any, timeout: float, rid: int = 0) -> Any:
        """Send a request and wait for its answer.  ``timeout`` seconds bound
        the whole round trip, including waiting for ZeroMQ send space; the
        pending entry is removed however the request ends."""
        chan = self._chan
        if chan.closed:
            raise ActorDead(f"connection to {self.endpoint} is closed")
        if self._watch.failure is not None:
            raise auth.HandshakeFailed(f"{self.endpoint}: {self._watch.failure}")
        rid = rid or next(self._ids)
        frames, tokens = self._frames(msg, _envelope((op, rid, target)))
        loop = self._loop
        fut = loop.create_future()
        pending = self._pending
        pending[rid] = fut
        timer = loop.call_later(timeout, _expire, fut, target, self.endpoint, timeout)
        try:
            queued = chan.send(frames)
            if queued is not None:   # high-water mark reached: wait for space or the timeout
                try:
                    await asyncio.wait((queued, fut), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not queued.done():
                        queued.cancel()
                        self._unsent(tokens)
            return await fut
        finally:
            timer.cancel()
            pending.pop(rid, None)

    async def send(self, target: str, msg: Any) -> None:
        """Send a tell; waits only while ZeroMQ's send queue is full."""
        if self._chan.closed:
            raise ActorDead(f"connection to {self.endpoint} is closed")
        frames, tokens = self._frames(msg, Envelope(OP_TELL, 0, target))
        queued = self._chan.send(frames)
        if queued is not None:
            try:
                await queued
            except asyncio.CancelledError:
                self._unsent(tokens)
                raise

    def send_nowait(self, target: str, msg: Any) -> None:
        """Send a tell or raise ``MailboxFull`` when ZeroMQ's send queue is full."""
        if self._chan.closed:
            raise ActorDead(f"connection to {self.endpoint} is closed")
        frames, tokens = self._frames(msg, Envelope(OP_TELL, 0, target))
        queued = self._chan.send(frames)
        if queued is not None:
            queued.cancel()
            self._unsent(tokens)
            raise MailboxFull(f"send queue to {self.endpoint} is full")

    def _on_answer(self, frames: list) -> None:
        pending = self._pending
        try:
            whole = wire.join(frames, self._max_frame, self._max_body)
            env, value = codec.decode(whole, max_frame=self._max_frame, max_body=self._max_body)
        except CodecError as exc:
            env = codec.decode_envelope(frames)
            fut = pending.get(env.request_id) if env else None
            if fut is not None and not fut.done():
                fut.set_exception(CodecError(f"undecodable answer: {exc}"))
            else:
                log.warning("undecodable answer from %s: %s", self.endpoint, exc)
            return
        op = env[0]
        if op == OP_RELEASE:
            self._released(value)
            return
        fut = pending.get(env[1])
        if fut is None or fut.done():
            return   # answer after a timeout: drop
        if op == OP_REPLY:
            fut.set_result(value)
        elif not isinstance(value, ErrorReply):
            fut.set_exception(CodecError(f"error answer without ErrorReply: {type(value).__name__}"))
        elif op == OP_RAISED:
            fut.set_exception(RemoteError(value.kind, value.message))
        else:
            fut.set_exception(RUNTIME_ERRORS.get(value.kind, ActorError)(value.message))

    def _released(self, tokens: Any) -> None:
        pool = self._shm_pool
        if pool is None or not isinstance(tokens, list):
            return
        for token in tokens:
            if isinstance(token, list) and len(token) == 2 and type(token[0]) is str and type(token[1]) is int:
                pool.release(token[0], token[1])

    def close(self) -> None:
        """Fail pending asks with ``ActorDead``, close the socket and unlink
        the shared-memory segments; idempotent."""
        if self._chan.closed:
            return
        self._watch.close()
        self._chan.close()
        if self._shm_handshake is not None:
            self._shm_handshake.cancel()
        if self._shm_pool is not None:
            self._shm_pool.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ActorDead(f"connection to {self.endpoint} closed"))


def _expire(fut: asyncio.Future, target: str, endpoint: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(AskTimeout(f"ask to {target!r} at {endpoint} got no answer within {timeout:g} s"))


class RemoteRef(ActorRef):
    """Ref to an actor in another process, reached through a ``Peer``.

    Same contract as a local ref, except that a remote ``tell`` returns once
    ZeroMQ took the message (it cannot see the remote mailbox; a tell to a
    stopped or unknown remote actor is logged there and dropped).  Tensors of
    64 KiB and more are sent zero-copy: do not modify them in place until the
    ask returned (for a tell: until the receiver acknowledged in some way).  ``alive``
    turns False after ``stop()``, after an ask answered ``ActorDead``, or when
    the connection is closed.
    """

    def __init__(self, peer: Peer, name: str, stop_timeout: float = 10.0):
        self.name = name
        self._peer = peer
        self._dead = False
        self._stop_timeout = stop_timeout

    @property
    def alive(self) -> bool:
        return not self._dead and not self._peer.closed

    def _check(self) -> None:
        if not self.alive:
            raise ActorDead(f"actor {self.name!r} at {self._peer.endpoint} is stopped")

    async def tell(self, msg: Any) -> None:
        self._check()
        await self._peer.send(self.name, msg)

    def tell_nowait(self, msg: Any) -> None:
        self._check()
        self._peer.send_nowait(self.name, msg)

    async def ask(self, msg: Any, timeout: float = 10.0) -> Any:
        if self._dead:
            self._check()
        try:
            return await self._peer.request(OP_ASK, self.name, msg, timeout)
        except ActorDead:
            self._dead = True
            raise

    async def stop(self) -> None:
        """Ask the remote system to stop the actor; returns once it stopped
        (or after ``stop_timeout`` when the peer does not answer)."""
        if self._dead:
            return
        self._dead = True
        try:
            await self._peer.request(OP_STOP, self.name, Ok(), self._stop_timeout)
        except (AskTimeout, ActorDead):
            pass
