"""The largest frame a socket takes, and messages with larger frames cut to fit.

ZeroMQ's decoder allocates a frame's declared size as soon as it reads the
frame header, before the security handshake has authenticated anybody.  So
every socket refuses frames above ``MAX_WIRE_FRAME`` (``ZMQ_MAXMSGSIZE``: a
peer that declares more is disconnected at the header, nothing allocated):
the transfer span size (``PIECE_BYTES``, ``--span-bytes``' default) plus
``SLACK_BYTES`` for what CURVE and ZMTP wrap around a frame.  A security
handshake not done within ``HANDSHAKE_S`` drops the connection.

A message frame larger than ``PIECE_BYTES`` (a body with a large graph, a
weight of ``LoadValues``, a step's outputs, a transfer sent whole) still
travels: ``split`` cuts it into consecutive pieces of at most
``PIECE_BYTES`` (views, no copy), sets ``FLAG_PIECES`` in the header and
appends a table ``msgpack [[frame_index, pieces], ...]`` as the last frame;
``join`` copies each frame's pieces back into one buffer of its own (the
receiver pays one copy of such frames; a transfer sent in spans is never split).
The shared-memory table (``transport.shm``), when there is one, is inside:
``split`` runs after ``shm_frames.to_shm`` and ``join`` before ``from_shm``.
"""
from __future__ import annotations

import mmap
from collections.abc import Sequence

import msgpack
import zmq

from tessera_actors.runtime.errors import CodecError

PIECE_BYTES = 4 << 20        # payload bytes of one ZeroMQ frame; also the transfer span size by default
SLACK_BYTES = 64 << 10       # CURVE's box and nonce, ZMTP's command name and flags, with room to spare
MAX_WIRE_FRAME = PIECE_BYTES + SLACK_BYTES
HANDSHAKE_S = 10.0           # a connection whose security handshake takes longer is dropped
FLAG_PIECES = 4              # header flag: the last frame is a table of split frames
_MAX_TABLE = 64 << 10        # bytes of a pieces table


def socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket with the project's options: linger 0, TCP keepalive, frames
    bounded by ``MAX_WIRE_FRAME``, handshakes by ``HANDSHAKE_S``."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    return sock


def _nbytes(frame) -> int:
    return frame.nbytes if type(frame) is memoryview else len(frame)


def split(frames: list) -> list:
    """``frames`` as they go on the wire: unchanged when every frame fits
    in ``PIECE_BYTES`` (the usual message), else with the larger ones cut
    into pieces and the table appended.  Non-blocking, no copy."""
    for i in range(1, len(frames)):
        if _nbytes(frames[i]) > PIECE_BYTES:
            break
    else:
        return frames
    header = bytearray(frames[0])
    header[5] |= FLAG_PIECES
    out, table = [bytes(header)], []
    for i in range(1, len(frames)):
        frame = frames[i]
        n = _nbytes(frame)
        if n <= PIECE_BYTES:
            out.append(frame)
            continue
        view = memoryview(frame).cast("B")
        out.extend(view[off:off + PIECE_BYTES] for off in range(0, n, PIECE_BYTES))
        table.append([i, -(-n // PIECE_BYTES)])
    out.append(msgpack.packb(table))
    return out


def is_split(frames: Sequence) -> bool:
    """Whether received frames carry a pieces table (reads the header only)."""
    if len(frames) < 4:   # (a header, two pieces at least, the table)
        return False
    header = getattr(frames[0], "buffer", frames[0])
    return len(header) == 6 and bool(header[5] & FLAG_PIECES)


def join(frames: Sequence, max_frame: int, max_body: int) -> Sequence:
    """The frames of a received message with each split frame whole again
    (a copy into memory of its own); ``frames`` unchanged when nothing was
    split.  Raises ``CodecError`` on a malformed table or a joined frame
    beyond ``max_body`` (the body) or ``max_frame`` (any other); blocking
    for as long as the copy takes."""
    if not is_split(frames):
        return frames
    bufs = [getattr(f, "buffer", f) for f in frames]
    raw_table = bufs.pop()
    if len(raw_table) > _MAX_TABLE:
        raise CodecError(f"pieces table of {len(raw_table)} bytes")
    try:
        table = msgpack.unpackb(raw_table, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:   # (msgpack's errors on garbage)
        raise CodecError(f"malformed pieces table: {type(exc).__name__}: {exc}") from None
    if not isinstance(table, list) or not table:
        raise CodecError("malformed pieces table: not a list of [frame, pieces]")
    header = bytearray(bufs[0])
    header[5] &= ~FLAG_PIECES & 0xFF
    out, src = [bytes(header)], 1
    for entry in table:
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and type(entry[1]) is int):
            raise CodecError(f"malformed pieces entry {entry!r}")
        index, count = entry
        gap = index - len(out)   # frames before this one that were not split
        if gap < 0 or count < 2 or src + gap + count > len(bufs):
            raise CodecError(f"pieces entry {entry!r} does not match the {len(bufs)} frames")
        out.extend(bufs[src:src + gap])
        src += gap
        out.append(_joined(bufs[src:src + count], max_body if index == 1 else max_frame))
        src += count
    out.extend(bufs[src:])
    return out


def _joined(pieces: list, limit: int) -> memoryview:
    total = sum(len(p) for p in pieces)
    if total > limit:
        raise CodecError(f"a frame of {total} bytes (in {len(pieces)} pieces) exceeds the limit {limit}")
    if any(len(p) != PIECE_BYTES for p in pieces[:-1]) or not pieces[-1]:
        raise CodecError("pieces of a split frame must be full but the last")
    buf = mmap.mmap(-1, total)   # private, writable, its pages touched only by the copy
    off = 0
    for p in pieces:
        buf[off:off + len(p)] = p
        off += len(p)
    return memoryview(buf)
