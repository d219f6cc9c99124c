"""Memory semantics of single PTX instructions.

:func:`accesses` answers, for one :class:`~ptx.model.Instruction`, which of
its operands is a memory address, in which state space, whether the access
reads, writes or both, and how many bytes it touches. The table errs towards
writing: an unknown instruction that takes a ``[address]`` operand in a space
that may be global counts as read-write. ``ld.param``/``st.param`` are not
memory accesses here (parameter passing is handled by the dataflow).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ptx.model import Instruction, type_bytes

READ, WRITE, READWRITE, UNKNOWN = "read", "write", "readwrite", "unknown"

_TYPE = re.compile(r"^(?:[bsuf]\d+|bf16|bf16x2|f16x2|pred)$")
_LOCAL_SPACES = {"shared", "shared::cta", "shared::cluster", "local", "const", "param"}
_NO_ACCESS = {"prefetch", "prefetchu", "applypriority", "fence", "membar", "bar", "barrier",
              "createpolicy", "isspacep", "mbarrier", "cp.async.bulk.prefetch",
              "ldmatrix", "stmatrix", "wgmma", "tcgen05", "griddepcontrol", "elect", "wmma"}
_OPAQUE = {"suld", "sust", "sured", "tex", "tld4", "txq", "suq", "multimem", "tensormap"}


@dataclass(frozen=True, slots=True)
class MemAccess:
    """One memory access of an instruction.

    ``operand``: index into ``Instruction.operands`` of the address operand.
    ``space``: ``global``, ``generic``, ``shared``, ``local``, ``const``...
    ``kind``: ``read``, ``write``, ``readwrite`` or ``unknown`` (address is not
    a plain pointer, e.g. a TMA tensor map or a texture handle).
    ``width``: bytes touched from the address, or ``None`` when not static.
    """

    operand: int
    space: str
    kind: str
    width: int | None


def value_type(ins: Instruction) -> str | None:
    """The last type modifier of an instruction (``u64`` in ``ld.global.u64``)."""
    for mod in reversed(ins.modifiers):
        if _TYPE.match(mod):
            return mod
    return None


def vector_width(ins: Instruction) -> int:
    """Lanes of a vector access: 4 for ``.v4``, else 1."""
    for mod in ins.modifiers:
        if len(mod) == 2 and mod[0] == "v" and mod[1].isdigit():
            return int(mod[1])
        if mod == "v8":
            return 8
    return 1


def _space(mods: tuple[str, ...]) -> str:
    for mod in mods:
        if mod == "global":
            return "global"
        if mod in _LOCAL_SPACES or mod.startswith("shared"):
            return "shared" if mod.startswith("shared") else mod
    return "generic"


def _width(ins: Instruction) -> int | None:
    t = value_type(ins)
    if t is None:
        return None
    try:
        return type_bytes(t) * vector_width(ins)
    except ValueError:
        return None


def _imm(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _bulk(ins: Instruction, mods: tuple[str, ...], reduce: bool) -> list[MemAccess]:
    if "tensor" in mods:
        # TMA through a tensor map: the global address is hidden in the map.
        return [MemAccess(1 if _dst_is_shared(mods) else 0, "global", UNKNOWN, None)]
    size = _imm(ins.operands[2]) if len(ins.operands) > 2 else None
    spaces = [m for m in mods if m == "global" or m.startswith("shared")]
    if not spaces or spaces[0] != "global":
        if "global" in spaces:
            return [MemAccess(1, "global", READ, size)]
        return []
    return [MemAccess(0, "global", READWRITE if reduce else WRITE, size)]


def _dst_is_shared(mods: tuple[str, ...]) -> bool:
    spaces = [m for m in mods if m == "global" or m.startswith("shared")]
    return bool(spaces) and spaces[0] != "global"


def accesses(ins: Instruction) -> list[MemAccess]:
    """Memory accesses of ``ins`` (empty for pure register instructions)."""
    op = ins.opcode
    base = ins.base
    mods = ins.modifiers
    if base in ("ld", "ldu"):
        space = _space(mods)
        if space == "param":
            return []
        return [MemAccess(1, space, READ, _width(ins))]
    if base == "st":
        space = _space(mods)
        if space == "param" or "async" in mods:
            return []
        return [MemAccess(0, space, WRITE, _width(ins))]
    if base in ("atom", "red"):
        return [MemAccess(1 if base == "atom" else 0, _space(mods), READWRITE, _width(ins))]
    if base == "cp":
        if op.startswith("cp.async.bulk.prefetch") or "commit_group" in mods or "wait_group" in mods \
                or "wait_group.read" in op or "wait_all" in mods:
            return []
        if op.startswith("cp.reduce.async.bulk"):
            return _bulk(ins, mods, reduce=True)
        if op.startswith("cp.async.bulk"):
            return _bulk(ins, mods, reduce=False)
        if op.startswith("cp.async"):
            size = _imm(ins.operands[2]) if len(ins.operands) > 2 else None
            return [MemAccess(1, "global", READ, size)]
    if base == "wmma" and ("load" in mods or "store" in mods):
        # a strided tile: the span depends on the runtime stride, so no width
        space = _space(mods)
        if "load" in mods:
            return [MemAccess(1, space, READ, None)]
        return [MemAccess(0, space, WRITE, None)]
    if base == "discard":
        return [MemAccess(0, _space(mods), WRITE, _imm(ins.operands[1]) if len(ins.operands) > 1 else None)]
    if base in _NO_ACCESS or op.startswith("cp.async.bulk.prefetch"):
        return []
    out = []
    for i, operand in enumerate(ins.operands):
        if operand.startswith("["):
            if base in _OPAQUE:
                out.append(MemAccess(i, "global", UNKNOWN, None))
                continue
            space = _space(mods)
            if space in ("global", "generic"):
                out.append(MemAccess(i, space, READWRITE, _width(ins)))
    if not out and base in _OPAQUE:
        out.append(MemAccess(0, "global", UNKNOWN, None))
    return out


_ADDR = re.compile(r"\[\s*([A-Za-z_$%][\w$.]*)?\s*(?:\+\s*)?(-?\s*(?:0[xX][0-9a-fA-F]+|\d+))?\s*\]")


def split_address(operand: str) -> tuple[str | None, int]:
    """``[%rd1+16]`` -> (``%rd1``, 16); ``[sym]`` -> (``sym``, 0); ``[64]`` -> (None, 64).

    For a TMA operand such as ``[%rd1, {%r1, %r2}]`` the base before the comma
    is returned. Raises ``ValueError`` if ``operand`` is not an address.
    """
    text = operand
    if "," in text:
        text = text.split(",", 1)[0] + "]"
    m = _ADDR.match(text.replace("+-", "+ -"))
    if m is None:
        raise ValueError(f"not an address operand: {operand!r}")
    off = m.group(2)
    return m.group(1), int(off.replace(" ", ""), 0) if off else 0
