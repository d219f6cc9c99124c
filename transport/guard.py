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

from typing import Any, Sequence

from tessera_actors.runtime.errors import CodecError
from transport import codec, shm

LIGHT_BODY = 16 << 10   # msgpack bytes decoded on the loop
LIGHT_FRAMES = 16       # tensor frames decoded on the loop (each wrapped without a copy)
MAX_QUEUED = 256        # requests waiting for the guard thread before the server stops reading


def is_light(payload: Sequence) -> bool:
    """Whether ``payload`` (a request's frames, without the sender's
    identity) can be decoded on the loop; cheap, reads only frame lengths
    and the header's flags."""
    if len(payload) > LIGHT_FRAMES + 2 or len(payload) < 2:
        return len(payload) < 2   # (a malformed request of no body fails at once, on the loop)
    if shm.has_shm(payload):
        return False
    return len(getattr(payload[1], "buffer", payload[1])) <= LIGHT_BODY


def decode_request(payload: Sequence, reader, owner, max_frame: int, max_body: int) -> tuple[Any, Any]:
    """``(envelope, message)`` of a request, its shared-memory tensors copied
    out of their segments (each at most ``max_frame`` bytes, checked before a
    page is touched); raises ``CodecError``.  Blocking: runs on the guard
    thread for requests that are not light."""
    try:
        if len(payload) > 3 and shm.has_shm(payload):
            payload = shm.from_shm(payload, reader, owner, max_frame)
        return codec.decode(payload, max_frame=max_frame, max_body=max_body)
    except CodecError:
        raise
    except (MemoryError, RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise CodecError(f"malformed request: {type(exc).__name__}: {exc}") from None
