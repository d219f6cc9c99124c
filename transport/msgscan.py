"""Bounds check of a msgpack document before it is unpacked.

``scan(data, max_depth, max_items)`` walks the msgpack bytes with an
explicit stack (no recursion, no allocation per object) and raises
``CodecError`` when the document is truncated, has trailing bytes, uses the
reserved byte 0xc1, declares more elements than bytes remain, holds more
than ``max_items`` objects, or nests deeper than ``max_depth``.  Nesting
counts containers and the documents inside ext types 1-3 (messages,
tensors, tuples: their payload is msgpack again) alike, so a chain of nested
ext types - which msgpack's C unpacker would follow by recursing through
the ext hook, one C stack frame of tens of KiB per level - is refused here,
before any unpacking starts.

Pure and synchronous; O(objects) host work (str/bin/ext bytes are skipped,
not read).  The codec runs it on bodies large enough for the object count
to matter; smaller bodies are bounded by the codec's ext-depth counter and
msgpack's own per-container limits.
"""
from __future__ import annotations

import struct

from tessera_actors.runtime.errors import CodecError

NESTED_EXT_CODES = frozenset((1, 2, 3))   # ext payloads that are msgpack documents themselves

_U8, _U16, _U32 = struct.Struct("!B"), struct.Struct("!H"), struct.Struct("!I")

# header byte -> (header size, how many bytes after the header to skip) for fixed-size scalars
_FIXED: dict[int, int] = {0xc0: 1, 0xc2: 1, 0xc3: 1, 0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9,
                          0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9}
# header byte -> (length field struct, kind) for length-prefixed objects
_SIZED: dict[int, tuple[struct.Struct, str]] = {
    0xc4: (_U8, "raw"), 0xc5: (_U16, "raw"), 0xc6: (_U32, "raw"),
    0xd9: (_U8, "raw"), 0xda: (_U16, "raw"), 0xdb: (_U32, "raw"),
    0xc7: (_U8, "ext"), 0xc8: (_U16, "ext"), 0xc9: (_U32, "ext"),
    0xdc: (_U16, "array"), 0xdd: (_U32, "array"), 0xde: (_U16, "map"), 0xdf: (_U32, "map"),
}
_FIXEXT = {0xd4: 1, 0xd5: 2, 0xd6: 4, 0xd7: 8, 0xd8: 16}


def scan(data, max_depth: int, max_items: int) -> int:
    """Check the bounds of one msgpack document filling ``data``; returns the
    number of objects.  Raises ``CodecError`` naming the first violation."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    end = len(view)
    pos = 0
    items = 0
    # each frame: [objects still to read, byte offset the frame must end at (-1: a container)]
    stack: list[list[int]] = [[1, end]]
    while stack:
        top = stack[-1]
        if top[0] == 0:
            stack.pop()
            if top[1] >= 0 and pos != top[1]:
                raise CodecError(f"msgpack document ends at byte {pos}, its frame says {top[1]}")
            continue
        top[0] -= 1
        if pos >= end:
            raise CodecError(f"msgpack data truncated at byte {pos}")
        items += 1
        if items > max_items:
            raise CodecError(f"message holds more than {max_items} objects")
        b = view[pos]
        if b <= 0x7f or b >= 0xe0:
            pos += 1
            continue
        if b <= 0x8f or 0x90 <= b <= 0x9f:   # fixmap / fixarray
            count = (b & 0x0f) * (2 if b <= 0x8f else 1)
            pos += 1
            if count:
                _open(stack, count, end - pos, pos, max_depth)
            continue
        if b <= 0xbf:   # fixstr
            pos += 1 + (b & 0x1f)
            continue
        skip = _FIXED.get(b)
        if skip is not None:
            pos += skip
            continue
        if b in _FIXEXT:
            size = _FIXEXT[b]
            code = _signed(view[pos + 1]) if pos + 1 < end else None
            pos = _ext(stack, code, pos + 2, size, end, max_depth)
            continue
        sized = _SIZED.get(b)
        if sized is None:
            raise CodecError(f"reserved msgpack byte 0x{b:02x} at {pos}")
        field, kind = sized
        head = pos + 1 + field.size
        if head > end:
            raise CodecError(f"msgpack length field truncated at byte {pos}")
        (length,) = field.unpack_from(view, pos + 1)
        if kind == "raw":
            pos = head + length
        elif kind == "ext":
            if head >= end:
                raise CodecError(f"msgpack ext type truncated at byte {pos}")
            pos = _ext(stack, _signed(view[head]), head + 1, length, end, max_depth)
        else:
            count = length * (2 if kind == "map" else 1)
            pos = head
            if count:
                _open(stack, count, end - pos, pos, max_depth)
    if pos != end:
        raise CodecError(f"{end - pos} trailing byte(s) after the msgpack document")
    return items


def _open(stack: list, count: int, remaining: int, pos: int, max_depth: int) -> None:
    if count > remaining:
        raise CodecError(f"container at byte {pos} declares {count} elements, {remaining} bytes remain")
    if len(stack) > max_depth:
        raise CodecError(f"msgpack nesting deeper than {max_depth}")
    stack.append([count, -1])


def _ext(stack: list, code: int | None, start: int, size: int, end: int, max_depth: int) -> int:
    """Account for an ext object whose payload is ``[start, start+size)``;
    returns where scanning continues."""
    stop = start + size
    if code is None or stop > end:
        raise CodecError(f"msgpack ext payload of {size} bytes at {start} runs past the end ({end})")
    if code not in NESTED_EXT_CODES:
        return stop
    if size == 0:
        raise CodecError(f"empty payload of ext type {code} at byte {start}")
    if len(stack) > max_depth:
        raise CodecError(f"msgpack nesting deeper than {max_depth}")
    stack.append([1, stop])   # the payload is one document that must end exactly at stop
    return start


def _signed(byte: int) -> int:
    return byte - 256 if byte >= 128 else byte
