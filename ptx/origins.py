"""Origins of values and the per-function facts the dataflow produces.

Origins (tuples, so they hash fast):

* ``("P", name, offset)``: derived from parameter ``name``; ``offset`` is the
  byte offset inside a struct (byte-array) parameter, 0 for plain ones, -1
  when unknown.
* ``("A", name)``: the address of a parameter (``mov %rd, param``).
* ``("S", name, space)``: address of a named variable in ``space``.
* ``MEM``: a 64-bit value loaded from memory (a pointer we cannot bound).
* ``UNKNOWN``: produced by something we cannot follow (an opaque call).
* ``LOCAL``: the local stack (``%SP``/``__local_depot``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ptx.memops import MemAccess
from ptx.model import Instruction

MEM = ("M",)
UNKNOWN = ("U",)
LOCAL = ("L",)
EMPTY: frozenset = frozenset()


@dataclass(slots=True)
class Site:
    """A memory access of the function with the provenance of its address."""

    index: int
    ins: Instruction
    access: MemAccess
    bases: frozenset


@dataclass(slots=True)
class Summary:
    """What a function does, in terms of its own parameters' origins.

    ``effects``: (kind, space, bases, line) for every access, callees included.
    ``returns``: return-parameter name -> origins of the value stored there.
    """

    params: list[str]
    returns_order: list[str]
    effects: list[tuple[str, str, frozenset, int]] = field(default_factory=list)
    returns: dict[str, frozenset] = field(default_factory=dict)


def substitute(bases: frozenset, params: list[str], values: list[frozenset]) -> frozenset:
    """Replace callee-parameter origins in ``bases`` by the caller's argument values."""
    out = EMPTY
    for o in bases:
        if o[0] == "P" and o[1] in params:
            pos = params.index(o[1])
            out = out | (values[pos] if pos < len(values) else frozenset((UNKNOWN,)))
        elif o[0] == "A" and o[1] in params:
            out = out | {LOCAL}
        else:
            out = out | {o}
    return out
