"""What a received request may cost the event loop, and where it is decoded.

A node's event loop answers heartbeats, pings and every other peer, so no
request may hold it for long (the bound the issue sets: 100 ms).  A *light*
request - a body of at most ``LIGHT_BODY`` bytes, at most ``LIGHT_FRAMES``
tensor frames (wrapped, not copied) and no shared-memory table - is decoded
on the loop: its cost is bounded by its size (tens of microseconds).
Anything else is decoded by :func:`decode_request` on the server's one
guard thread: the bounds check of the body (``transport.msgscan``, Python,
so the loop gets the GIL back every switch interval), the copies out of
shared memory (``preadv`` releases the GIL) and the unpacking, whose C part
holds the GIL but is bounded by ``codec.MAX_ITEMS`` objects.  The server
keeps each sender's requests in order (``transport.endpoint``) and stops
reading once ``MAX_QUEUED`` requests wait for the guard thread.
"""
from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from tessera_actors.runtime.errors import CodecError
from transport import codec, shm_frames, wire

LIGHT_BODY = 16 << 10   # msgpack bytes decoded on the loop
LIGHT_FRAMES = 16       # tensor frames decoded on the loop (each wrapped without a copy)
MAX_QUEUED = 256        # requests waiting for the guard thread before the server stops reading


def is_light(payload: Sequence) -> bool:
    """Whether ``payload`` (a request's frames, without the sender's
    identity) can be decoded on the loop; cheap, reads only frame lengths
    and the header's flags."""
    if len(payload) > LIGHT_FRAMES + 2 or len(payload) < 2:
        return len(payload) < 2   # (a malformed request of no body fails at once, on the loop)
    if shm_frames.has_shm(payload) or wire.is_split(payload):
        return False
    return len(getattr(payload[1], "buffer", payload[1])) <= LIGHT_BODY


def decode_request(payload: Sequence, reader, owner, max_frame: int, max_body: int) -> tuple[Any, Any]:
    """``(envelope, message)`` of a request, its shared-memory tensors copied
    out of their segments (each at most ``max_frame`` bytes, checked before a
    page is touched); raises ``CodecError``.  Blocking: runs on the guard
    thread for requests that are not light."""
    try:
        payload = wire.join(payload, max_frame, max_body)
        if len(payload) > 3 and shm_frames.has_shm(payload):
            payload = shm_frames.from_shm(payload, reader, owner, max_frame)
        return codec.decode(payload, max_frame=max_frame, max_body=max_body)
    except CodecError:
        raise
    except (MemoryError, RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise CodecError(f"malformed request: {type(exc).__name__}: {exc}") from None


class Guard:
    """A server's guard thread and the requests waiting for it.

    ``receive(frames)`` (on the loop, frames with the sender's identity
    first): a light request is decoded and ``serve(identity, payload,
    decoded)``-d at once; a heavy one goes to the guard thread, and the same
    sender's later requests queue behind it, so each sender's order is kept
    (other senders go on).  ``decode(payload, identity)`` returns
    ``(envelope, message)`` or the ``CodecError``; ``pause``/``resume`` stop
    and restart the server's reading while ``MAX_QUEUED`` requests wait."""

    def __init__(self, decode: Callable[[list, Any], Any], serve: Callable[[Any, list, Any], None],
                 pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._decode, self._serve, self._pause, self._resume = decode, serve, pause, resume
        self._backlog: dict[bytes, deque] = {}   # sender -> its requests behind one on the guard thread
        self._queued = 0                          # requests waiting for the guard thread, over all senders
        self._pool: ThreadPoolExecutor | None = None   # made on first use
        self._tasks: set[asyncio.Task] = set()

    def receive(self, frames: list) -> None:
        identity, payload = frames[0], frames[1:]
        backlog = self._backlog.get(identity.bytes)
        if backlog is not None:
            backlog.append(frames)
            self._queued += 1
            if self._queued == MAX_QUEUED:
                self._pause()   # ZeroMQ's high-water mark holds the senders back meanwhile
        elif is_light(payload):
            self._serve(identity, payload, self._decode(payload, identity))
        else:
            self._backlog[identity.bytes] = deque()
            self._queued += 1
            task = asyncio.get_running_loop().create_task(self._drain(identity, frames))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain(self, identity, frames: list | None) -> None:
        """Serve a sender's heavy request, then its requests that arrived meanwhile, in order."""
        backlog = self._backlog[identity.bytes]
        try:
            while frames is not None:
                payload = frames[1:]
                decoded = (self._decode(payload, identity) if is_light(payload)
                           else await self.run(self._decode, payload, identity))
                self._unqueue()
                frames = None
                self._serve(identity, payload, decoded)
                frames = backlog.popleft() if backlog else None
        finally:
            for _ in range(len(backlog) + (frames is not None)):
                self._unqueue()
            self._backlog.pop(identity.bytes, None)

    def _unqueue(self) -> None:
        self._queued -= 1
        if self._queued == MAX_QUEUED - 1:
            self._resume()

    def run(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` on the guard thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-guard")
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
