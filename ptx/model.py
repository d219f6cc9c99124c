"""Parsed PTX as plain, immutable-by-convention data.

The parser (:mod:`ptx.parser`) builds these objects; analysis, features and
instrumentation read them. Nothing here knows about memory semantics.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_BITS = re.compile(r"(\d+)$")
_MODIFIERS: dict[str, tuple[str, ...]] = {}  # opcode -> modifiers; opcodes repeat a lot
_TYPE_BYTES: dict[str, int] = {}


def type_bytes(ptx_type: str) -> int:
    """Size in bytes of a PTX fundamental type such as ``.u64`` or ``f16x2``.

    ``.pred`` counts as 1; a type without a bit width raises ``ValueError``.
    """
    hit = _TYPE_BYTES.get(ptx_type)
    if hit is not None:
        return hit
    _TYPE_BYTES[ptx_type] = size = _type_bytes(ptx_type)
    return size


def _type_bytes(ptx_type: str) -> int:
    t = ptx_type.lstrip(".")
    if t == "pred":
        return 1
    if t.endswith("x2") and t[:-2] in ("f16", "bf16", "e4m3", "e5m2"):
        return 4 if t.startswith(("f16", "bf16")) else 2
    m = _BITS.search(t)
    if m is None:
        raise ValueError(f"unknown PTX type {ptx_type!r}")
    return max(1, int(m.group(1)) // 8)


@dataclass(slots=True)
class Param:
    """One parameter of an ``.entry``/``.func``.

    ``array_len`` is set for byte-array (struct-by-value) parameters such as
    ``.param .align 8 .b8 p[16]``; ``size`` is then ``elem size * array_len``.
    ``is_ptr`` is true when declared with the ``.ptr`` attribute (Triton).
    """

    index: int
    name: str
    type: str
    size: int
    line: int
    align: int | None = None
    array_len: int | None = None
    is_ptr: bool = False
    ptr_space: str | None = None

    @property
    def is_aggregate(self) -> bool:
        """True for byte-array parameters (structs passed by value)."""
        return self.array_len is not None

    @property
    def may_hold_pointer(self) -> bool:
        """True when the parameter is wide enough to carry a 64-bit address."""
        return self.is_ptr or self.size >= 8


@dataclass(slots=True)
class Instruction:
    """One PTX instruction.

    ``opcode`` is the full dotted mnemonic (``ld.global.nc.v4.f32``);
    ``operands`` are split at top-level commas and stripped; ``guard`` is the
    predicate text without ``@`` (``%p1`` or ``!%p1``), or ``None``;
    ``base`` is the mnemonic without modifiers (the parser fills it in; use
    :meth:`make` when building instructions by hand).
    """

    line: int
    opcode: str
    operands: tuple[str, ...]
    guard: str | None = None
    base: str = ""

    @classmethod
    def make(cls, line: int, opcode: str, operands: tuple[str, ...], guard: str | None = None) -> "Instruction":
        """Build an instruction, deriving ``base`` (``ld`` for ``ld.global.f32``)."""
        return cls(line, opcode, operands, guard, opcode.partition(".")[0])

    @property
    def modifiers(self) -> tuple[str, ...]:
        """The dotted modifiers after the mnemonic, in order."""
        mods = _MODIFIERS.get(self.opcode)
        if mods is None:
            mods = _MODIFIERS[self.opcode] = tuple(self.opcode.split(".")[1:])
        return mods


@dataclass(slots=True)
class Label:
    """A branch target ``name:`` at ``line``."""

    name: str
    line: int


@dataclass(slots=True)
class Directive:
    """A directive inside a body (``.reg``, ``.shared``, ``.local``, ``.param``...).

    ``text`` is the full statement without the trailing semicolon.
    """

    kind: str
    text: str
    line: int


@dataclass(slots=True)
class Symbol:
    """A named variable in a state space (``.global``, ``.shared``, ...)."""

    name: str
    space: str
    size: int
    line: int
    extern: bool = False


@dataclass(slots=True)
class Function:
    """An ``.entry`` kernel or a ``.func`` device function.

    ``body`` holds :class:`Instruction`, :class:`Label` and
    :class:`Directive` objects in source order, nested ``{ }`` blocks
    flattened. ``body_start``/``body_end`` are the lines of the braces
    (``None`` for a declaration without body).
    """

    name: str
    is_entry: bool
    params: list[Param]
    returns: list[Param]
    line: int
    linkage: str = ""
    header_text: str = ""
    body: list = field(default_factory=list)
    symbols: dict[str, Symbol] = field(default_factory=dict)
    registers: dict[str, str] = field(default_factory=dict)
    body_start: int | None = None
    body_end: int | None = None

    @property
    def instructions(self) -> list[Instruction]:
        """The instructions of the body, in order."""
        return [s for s in self.body if isinstance(s, Instruction)]

    def callees(self) -> set[str]:
        """The names of the functions the body calls (each ``call``'s first
        operand that is neither a return list ``(...)`` nor a register)."""
        out = set()
        for s in self.instructions:
            if s.base == "call":
                name = next((op for op in s.operands if not op.startswith(("(", "%"))), None)
                if name is not None:
                    out.add(name)
        return out

    def param(self, name: str) -> Param | None:
        """The parameter called ``name``, or ``None``."""
        for p in self.params:
            if p.name == name:
                return p
        return None


@dataclass(slots=True)
class Module:
    """A whole PTX file: header directives, module symbols, functions."""

    version: str
    target: str
    address_size: int
    functions: dict[str, Function]
    symbols: dict[str, Symbol]
    line_count: int

    @property
    def entries(self) -> list[Function]:
        """The kernels (``.entry`` with a body), in file order."""
        return [f for f in self.functions.values() if f.is_entry]
