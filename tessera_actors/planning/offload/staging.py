"""Where a step's streamed weights land in a device's staging ring, and
which reads each copy must wait for: the one layout the offload planner's
step model (``offload/model.py``) and the executor (``actors/streaming.py``)
share.  Pure Python.

A ring is ``slots`` slots of ``slot_bytes`` bytes of device memory (each
starting at a multiple of ``ALIGN``).  Copy ``i`` of a
step (the streamed weights in the order of their readers) goes to
``offsets[i]``, the same every step (CUDA graphs record the pointers):

* ``slots``: copy ``i`` fills slot ``i % slots``; a slot holds one weight
  however small, so the copy stream runs ``slots - 1`` weights ahead;
* ``bytes``: copies are packed by bytes (each starts at a multiple of
  ``ALIGN``), so small weights leave room for more of them.  Each copy goes
  where the bytes it overwrites were read the longest ago (in the steady
  state, the step before's last copies included), so the copy stream runs
  about as many bytes ahead as the ring holds, across the step's end too.
  Packing copies one after the other and wrapping to 0 when one would run
  past the end left the tail of every lap unused and made the next step's
  first copy wait for the read of this step's last (Llama-8B b8 on an
  H200, 112 and 32 MiB weights in 336 MiB: no lookahead at the step's end);
  that layout is kept where it looks further ahead (:func:`lookahead`).

A copy may go out once every earlier copy whose bytes it overwrites has
been read: ``after[i]`` is the latest such copy of the same step (-1: none,
the copy goes out when the step starts), made non-decreasing so copies go
out in order.  A step's first copies overwrite the step before's last
ones: ``wrap[i]`` (for copies with ``after[i] == -1``) is the latest copy
of the step before that they overwrite, so the reader of that copy may
queue them for the next step (non-decreasing as well).
"""
from __future__ import annotations

import functools
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
        return _waits(sizes, [(i % slots) * slot_pitch(slot_bytes) for i in range(m)])
    return _packed(tuple(sizes), cap)


@functools.lru_cache(maxsize=256)   # the planner's step model asks again for every placement it scores
def _packed(sizes: tuple[int, ...], cap: int) -> RingLayout:
    """``bytes`` mode (module docstring): the layout that looks furthest
    ahead of the copies one after the other and of each step placed behind
    the one before until the layout repeats."""
    best = _waits(sizes, _in_turn(sizes, cap))
    held: list[tuple[int, int, int]] = []
    seen: set[tuple[int, ...]] = set()
    for _ in range(PASSES):
        offsets, held = _oldest_first(sizes, cap, held)
        if tuple(offsets) in seen:
            break
        seen.add(tuple(offsets))
        lay = _waits(sizes, offsets)
        if lookahead(sizes, lay, cap) > lookahead(sizes, best, cap):
            best = lay
    return best


PASSES = 6   # steps placed one behind the other at most, looking for the layout that repeats


def _in_turn(sizes: Sequence[int], cap: int) -> list[int]:
    """Each copy after the one before, wrapping to 0 when it would run past ``cap``."""
    offsets, pos = [], 0
    for n in sizes:
        if pos + n > cap:
            pos = 0
        offsets.append(pos)
        pos += -(-n // ALIGN) * ALIGN   # the next copy starts aligned (kernels read weights at it)
    return offsets


def _oldest_first(sizes: Sequence[int], cap: int, held: list[tuple[int, int, int]]
                  ) -> tuple[list[int], list[tuple[int, int, int]]]:
    """One step's offsets, each copy where the bytes it overwrites were read
    the longest ago, given ``held``: ``(start, end, copy)`` of what the ring
    holds (copies of the step before numbered from ``-len(sizes)``); and
    what the ring holds after the step, numbered for the next one."""
    offsets = []
    for i, n in enumerate(sizes):
        starts = {0, (cap - n) // ALIGN * ALIGN} | {e for _, e0, _ in held
                                                   for e in [-(-e0 // ALIGN) * ALIGN] if e + n <= cap}

        def age(at: int) -> tuple:
            hit = [(c, min(e, at + n) - max(s, at)) for s, e, c in held if s < at + n and at < e]
            return max((c for c, _ in hit), default=-len(sizes) - 1), sum(c * b for c, b in hit), at
        at = min(starts, key=age)
        kept = [(s, e, c) for s, e, c in held if e <= at or s >= at + n]
        kept += [(s, at, c) for s, e, c in held if s < at < e]
        kept += [(at + n, e, c) for s, e, c in held if s < at + n < e]
        held = kept + [(at, at + n, i)]
        offsets.append(at)
    return offsets, [(s, e, c - len(sizes)) for s, e, c in held]


def _waits(sizes: Sequence[int], offsets: Sequence[int]) -> RingLayout:
    """The layout of copies at ``offsets``: which reads each waits for (module docstring)."""
    m = len(sizes)

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


def lookahead(sizes: Sequence[int], lay: RingLayout, cap: int) -> tuple[int, int]:
    """How far the copy stream may run ahead under ``lay``: for each copy,
    the bytes queued between the read it waits for and itself (the step
    before's copies too, for the first ones), at most ``cap``; (their sum,
    the least)."""
    m = len(sizes)
    pre = [0]
    for n in sizes:
        pre.append(pre[-1] + n)
    ahead = []
    for i in range(m):
        if lay.after[i] >= 0:
            ahead.append(pre[i] - pre[lay.after[i] + 1])
        else:
            ahead.append(pre[m] - pre[lay.wrap[i] + 1] + pre[i])
    return sum(min(a, cap) for a in ahead), min(ahead)


__all__ = ["ALIGN", "RING_MODES", "RingLayout", "lookahead", "ring_layout", "slot_pitch"]
