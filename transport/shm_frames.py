"""A message's frames to and from shared memory (:mod:`.shm`): large tensor
frames are moved into pool segments on send and a table of descriptors
rides as the last frame; the receiver copies the bytes out of the segments
the table names (``FLAG_SHM`` in the header says a table is there)."""
from __future__ import annotations

from typing import Sequence

import msgpack

from tessera_actors.runtime.errors import CodecError
from transport.shm import FLAG_SHM, SegmentPool, SegmentReader


def to_shm(frames: list, pool: SegmentPool, threshold: int) -> tuple[list, list]:
    """Move tensor frames of ``threshold`` bytes or more into pool segments.

    Returns the frames to send and the ``(name, generation)`` tokens used
    (release them if the message is dropped unsent).  Frames stay as they
    are when the pool is full."""
    table, tokens, out = [], [], None
    for i in range(2, len(frames)):
        frame = frames[i]
        nbytes = frame.nbytes if type(frame) is memoryview else len(frame)
        if nbytes < threshold:
            continue
        seg = pool.acquire(nbytes)
        if seg is None:
            continue
        seg.write(frame)
        if out is None:
            out = list(frames)
        out[i] = b""
        table.append([i - 2, seg.name, seg.generation, nbytes])
        tokens.append((seg.name, seg.generation))
    if out is None:
        return frames, tokens
    header = bytearray(frames[0])
    header[5] |= FLAG_SHM
    out[0] = bytes(header)
    out.append(msgpack.packb(table))
    return out, tokens


def has_shm(frames: Sequence) -> bool:
    """Whether received frames carry a shared-memory table (cheap check)."""
    if len(frames) < 4:
        return False
    header = getattr(frames[0], "buffer", frames[0])
    return len(header) == 6 and bool(header[5] & FLAG_SHM)


def from_shm(frames: Sequence, reader: SegmentReader | None, owner, max_frame: int = 4 << 30) -> list:
    """Replace shared-memory descriptors with the bytes they describe (copied
    out); raises ``CodecError`` on a malformed table, a segment that cannot
    be read, or a descriptor of more than ``max_frame`` bytes (refused before
    any page of the segment or of a receive buffer is touched)."""
    if reader is None:
        raise CodecError("shared-memory frames on a link without a shared-memory handshake")
    bufs = [getattr(f, "buffer", f) for f in frames[:-1]]
    try:
        table = msgpack.unpackb(getattr(frames[-1], "buffer", frames[-1]), raw=False)
    except Exception as exc:
        raise CodecError(f"malformed shared-memory table: {type(exc).__name__}: {exc}") from None
    if not isinstance(table, list) or not table:
        raise CodecError("malformed shared-memory table: not a list of descriptors")
    header = bytearray(bufs[0])
    header[5] &= ~FLAG_SHM & 0xFF
    bufs[0] = bytes(header)
    seen: set[int] = set()
    for entry in table:
        if not (isinstance(entry, list) and len(entry) == 4 and type(entry[0]) is int and type(entry[1]) is str
                and type(entry[2]) is int and type(entry[3]) is int):
            raise CodecError(f"malformed shared-memory descriptor {entry!r}")
        index, name, generation, nbytes = entry
        slot = index + 2
        if not 2 <= slot < len(bufs) or index in seen or len(bufs[slot]) != 0 or nbytes < 1:
            raise CodecError(f"shared-memory descriptor {entry!r} does not match the frames")
        if nbytes > max_frame:
            raise CodecError(f"shared-memory descriptor of {nbytes} bytes exceeds the frame limit {max_frame}")
        seen.add(index)
        bufs[slot] = reader.read(owner, name, generation, nbytes)
    return bufs
