"""Spans of transfer bytes: pure functions over byte offsets (no torch).

A transfer moves the bytes ``ranges`` of one buffer, concatenated in range
order: its *stream*.  Above ``span_bytes`` the stream travels as spans
``(offset, nbytes)`` so that staging, the wire and the receiver's write of
consecutive spans overlap; the receiver writes each span into the stream
slice it covers (``sub_ranges``), in whatever order spans arrive.
"""
from __future__ import annotations

from typing import Sequence

from transport.wire import PIECE_BYTES

DEFAULT_SPAN_BYTES = PIECE_BYTES   # a span is one frame on the wire (larger ones are split into pieces of this)


def split_spans(nbytes: int, span_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each span of a stream of ``nbytes``; one span
    (possibly empty) when ``span_bytes`` is 0 or the stream fits in one."""
    if nbytes < 0 or span_bytes < 0:
        raise ValueError(f"negative size: nbytes={nbytes}, span_bytes={span_bytes}")
    if span_bytes == 0 or nbytes <= span_bytes:
        return [(0, nbytes)]
    return [(off, min(span_bytes, nbytes - off)) for off in range(0, nbytes, span_bytes)]


def sub_ranges(ranges: Sequence[Sequence[int]], offset: int, nbytes: int) -> list[tuple[int, int]]:
    """The buffer ranges that stream bytes ``[offset, offset + nbytes)`` of
    ``ranges`` occupy, in stream order.  ``ValueError`` when the slice runs
    past the end of the stream."""
    out: list[tuple[int, int]] = []
    pos, want_end = 0, offset + nbytes
    for s, e in ranges:
        lo, hi = max(offset, pos), min(want_end, pos + e - s)
        if lo < hi:
            out.append((s + lo - pos, s + hi - pos))
        pos += e - s
        if pos >= want_end:
            break
    if offset < 0 or want_end > pos:
        raise ValueError(f"bytes [{offset}, {want_end}) are outside a stream of {pos} bytes")
    return out
