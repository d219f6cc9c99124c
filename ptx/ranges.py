"""Turn recovered probe slots into exact byte ranges per kernel parameter.

Pure functions, no device code: the caller launches the instrumented kernel
(see :mod:`ptx.instrument`), copies the slot buffer back to the host and
calls :func:`param_ranges` with the launch's actual pointer arguments.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ptx.instrument import SiteInfo

_EMPTY = 0xFFFFFFFFFFFFFFFF


def decode_slots(raw: bytes, n_sites: int) -> list[tuple[int, int] | None]:
    """Slots as (min address, max address), ``None`` for a site never executed."""
    if len(raw) < 16 * n_sites:
        raise ValueError(f"slot buffer has {len(raw)} bytes, need {16 * n_sites}")
    vals = struct.unpack_from(f"<{2 * n_sites}Q", raw)
    out: list[tuple[int, int] | None] = []
    for i in range(n_sites):
        lo, hi = vals[2 * i], vals[2 * i + 1]
        out.append(None if lo == _EMPTY or lo > hi else (lo, hi))
    return out


@dataclass(slots=True)
class ParamRanges:
    """Byte ranges ``[start, end)`` relative to the parameter's base address.

    ``read``/``write`` are the hulls over all sites that hit the buffer;
    ``sites`` lists the contributing site indices. ``exact`` is False when
    a contributing site has no static width (e.g. a strided WMMA tile): the
    range then covers only the first byte of each access at the extremes and
    is a lower bound.
    """

    read: tuple[int, int] | None = None
    write: tuple[int, int] | None = None
    sites: list[int] = field(default_factory=list)
    exact: bool = True

    @property
    def access(self) -> str:
        """``read``, ``write``, ``readwrite`` or ``none`` as observed."""
        if self.read and self.write:
            return "readwrite"
        return "read" if self.read else "write" if self.write else "none"


def _hull(a: tuple[int, int] | None, b: tuple[int, int]) -> tuple[int, int]:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]))


def param_ranges(sites: list[SiteInfo], slots: list[tuple[int, int] | None],
                 buffers: dict[str, tuple[int, int]]) -> tuple[dict[str, ParamRanges], list[int]]:
    """Attribute every executed site to the buffers its addresses fall in.

    ``buffers``: parameter name -> (device base address, size in bytes).
    Attribution is by address containment, so it is exact even for sites the
    static analysis could not attribute (indirect kernels, device functions).
    Returns (ranges per parameter that was touched, indices of executed sites
    whose addresses fall in no buffer).
    """
    out: dict[str, ParamRanges] = {}
    stray: list[int] = []
    for site, slot in zip(sites, slots):
        if slot is None:
            continue
        lo, hi = slot
        end = hi + (site.width or 1)
        hit = False
        for name, (base, size) in buffers.items():
            if base <= lo < base + size:
                hit = True
                r = out.setdefault(name, ParamRanges())
                span = (lo - base, min(end, base + size) - base if end > base + size else end - base)
                if site.kind in ("read", "readwrite"):
                    r.read = _hull(r.read, span)
                if site.kind in ("write", "readwrite"):
                    r.write = _hull(r.write, span)
                r.sites.append(site.index)
                r.exact &= site.width is not None
        if not hit:
            stray.append(site.index)
    return out, stray
