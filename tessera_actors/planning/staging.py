"""Where a step's streamed weights land in a device's staging ring, and
which reads each copy must wait for: the one layout the offload planner's
step model (``offload.py``) and the executor (``tessera_actors/execution/streaming.py``)
share.  Pure Python.

A ring is ``slots`` slots of ``slot_bytes`` bytes of device memory (each
starting at a multiple of ``ALIGN``).  Copy ``i`` of a
step (the streamed weights in the order of their readers) goes to
``offsets[i]``, the same every step (CUDA graphs record the pointers):

* ``slots``: copy ``i`` fills slot ``i % slots``; a slot holds one weight
  however small, so the copy stream runs ``slots - 1`` weights ahead;
* ``bytes``: each copy starts after the one before (at the next multiple of
  ``ALIGN`` bytes) and wraps to 0 when it would run past the end, so small weights leave room for more of
  them: the copy stream runs as many bytes ahead as the ring holds.

A copy may go out once every earlier copy whose bytes it overwrites has
been read: ``after[i]`` is the latest such copy of the same step (-1: none,
the copy goes out when the step starts), made non-decreasing so copies go
out in order.  A step's first copies overwrite the step before's last
ones: ``wrap[i]`` (for copies with ``after[i] == -1``) is the latest copy
of the step before that they overwrite, so the reader of that copy may
queue them for the next step (non-decreasing as well).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

RING_MODES = ("slots", "bytes")
ALIGN = 256   # bytes: where a copy starts in ``bytes`` mode


def slot_pitch(slot_bytes: int) -> int:
    """Bytes from one slot's start to the next: ``slot_bytes`` rounded up to
    ``ALIGN`` (a ring allocates ``slots`` of them)."""
    return -(-slot_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class RingLayout:
    offsets: tuple[int, ...]
    after: tuple[int, ...]
    wrap: tuple[int, ...]    # one per copy with after == -1 (they come first)


def ring_layout(sizes: Sequence[int], slots: int, slot_bytes: int, mode: str = "slots") -> RingLayout:
    """The layout of copies of ``sizes`` bytes in a ring of ``slots`` x
    ``slot_bytes``; ``ValueError`` for an unknown mode or a copy the ring
    (or, in ``slots`` mode, a slot) cannot hold."""
    if mode not in RING_MODES:
        raise ValueError(f"unknown staging ring mode {mode!r}; known: {', '.join(RING_MODES)}")
    m = len(sizes)
    if m == 0:
        return RingLayout((), (), ())
    cap = slots * slot_bytes
    unit = slot_bytes if mode == "slots" else cap
    if slots < 1 or max(sizes) > unit:
        raise ValueError(f"a copy of {max(sizes)} bytes does not fit {slots} staging slots of {slot_bytes} bytes "
                         f"({mode} mode)")
    if mode == "slots":
        offsets = [(i % slots) * slot_pitch(slot_bytes) for i in range(m)]
    else:
        offsets, pos = [], 0
        for n in sizes:
            if pos + n > cap:
                pos = 0
            offsets.append(pos)
            pos += -(-n // ALIGN) * ALIGN   # the next copy starts aligned (kernels read weights at it)

    def overlap(i: int, j: int) -> bool:
        return offsets[i] < offsets[j] + max(sizes[j], 1) and offsets[j] < offsets[i] + max(sizes[i], 1)
    after, last = [], -1
    for i in range(m):
        latest = next((j for j in range(i - 1, -1, -1) if overlap(j, i)), -1)
        last = max(last, latest)
        after.append(last)
    wrap, last = [], -1
    for i in range(m):
        if after[i] >= 0:
            break
        latest = next((j for j in range(m - 1, -1, -1) if overlap(j, i)), i)
        last = max(last, latest)
        wrap.append(last)
    return RingLayout(tuple(offsets), tuple(after), tuple(wrap))


__all__ = ["ALIGN", "RING_MODES", "RingLayout", "ring_layout", "slot_pitch"]
