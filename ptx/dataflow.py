"""Address provenance: which parameters (or other origins) each register may hold.

A flow-insensitive fixpoint over one function body: every register's value is
the union of what all of its assignments may produce, iterated until nothing
changes. That is sound across branches and loops (it covers every path) and,
because nvcc and LLVM emit PTX in near-SSA form, it loses little precision.

Origins (tuples, so they hash fast):

* ``("P", name, offset)``: derived from parameter ``name``; ``offset`` is the
  byte offset inside a struct (byte-array) parameter, 0 for plain ones, -1
  when unknown.
* ``("A", name)``: the address of a parameter (``mov %rd, param``).
* ``("S", name, space)``: address of a named variable in ``space``.
* ``MEM``: a 64-bit value loaded from memory (a pointer we cannot bound).
* ``UNKNOWN``: produced by something we cannot follow (an opaque call).
* ``LOCAL``: the local stack (``%SP``/``__local_depot``).

Products (mul, shl, ...) drop origins: a scaled pointer is an index, never a
base. If an address ends up with no base at all, the caller treats it as
unknown, which keeps the analysis conservative.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .memops import MemAccess, accesses, split_address, value_type
from .model import Function, Instruction, Module, type_bytes

MEM = ("M",)
UNKNOWN = ("U",)
LOCAL = ("L",)
EMPTY: frozenset = frozenset()

_TOKEN = re.compile(r"(?<![\w$.%])[%A-Za-z_$][\w$]*")
_KILL = {"mul", "mul24", "mad24", "shl", "shr", "shf", "div", "rem", "neg", "not", "cnot", "popc",
         "clz", "brev", "bfind", "bfe", "setp", "set", "testp", "fma", "sqrt", "rsqrt", "rcp", "sin",
         "cos", "lg2", "ex2", "tanh", "sad", "dp4a", "dp2a", "copysign", "abs", "vote", "activemask",
         "shfl", "match", "redux", "mma", "wgmma", "ldmatrix", "prmt", "fns", "szext", "bmsk",
         "bra", "ret", "exit", "bar", "barrier", "membar", "fence", "trap", "brkpt", "nanosleep",
         "griddepcontrol", "mbarrier", "elect", "getctarank", "mapa", "isspacep", "tcgen05",
         "createpolicy", "prefetch", "prefetchu", "cp", "stmatrix", "st", "red", "pmevent",
         "applypriority", "discard", "setmaxnreg", "fence.proxy", "wmma", "movmatrix"}
_FIRST_ONLY = {"sub", "subc"}
_TWO_OF_THREE = {"selp", "slct", "bfi"}
_HARMLESS_EXTERNS = {"vprintf", "__assertfail", "__assert_fail", "__nv_static_64__",
                     "cudaGetParameterBufferV2", "cudaLaunchDeviceV2"}


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


@dataclass(slots=True)
class _Call:
    line: int
    callee: str | None
    args: list[tuple]
    rets: list[str]
    values: list[frozenset] = field(default_factory=list)


class Provenance:
    """Runs the fixpoint for ``fn``; read ``sites``, ``calls`` and ``summary``.

    ``summaries`` maps callee names to their :class:`Summary` (computed
    bottom-up by the caller of this class); a callee missing from it is
    treated conservatively (reads and writes everything it is given, returns
    an unknown value).
    """

    def __init__(self, fn: Function, module: Module, summaries: dict[str, Summary]) -> None:
        self.fn = fn
        self.module = module
        self.summaries = summaries
        self.regs: dict[str, frozenset] = {}
        self.cells: dict[str, frozenset] = {"local": EMPTY, "shared": EMPTY}
        self.calls: list[_Call] = []
        self.sites: list[Site] = []
        self._flows: list[tuple] = []
        self._ret_stores: list[tuple[str, str]] = []
        self._params = {p.name: p for p in fn.params}
        self._memo: dict[str, tuple] = {}
        self._prepare()
        self._solve()
        self._collect_sites()

    # -- operand helpers ---------------------------------------------------
    def _const_origin(self, name: str) -> tuple | None:
        if name in ("%SP", "%SPL"):
            return None
        if name in self._params:
            return ("A", name)
        sym = self.fn.symbols.get(name) or self.module.symbols.get(name)
        if sym is not None:
            return LOCAL if sym.space == "local" else ("S", name, sym.space)
        return None

    def _sources(self, operands) -> tuple:
        """Register names and constant origins read by ``operands`` (memoised per operand)."""
        memo = self._memo
        if len(operands) == 1:
            hit = memo.get(operands[0])
            return hit if hit is not None else self._one(operands[0])
        out: tuple = ()
        for operand in operands:
            hit = memo.get(operand)
            out += hit if hit is not None else self._one(operand)
        return out

    def _one(self, operand: str) -> tuple:
        refs = []
        for tok in _TOKEN.findall(operand):
            if tok[0] == "%":
                refs.append(tok)
            else:
                origin = self._const_origin(tok)
                if origin is not None:
                    refs.append(frozenset((origin,)))
        self._memo[operand] = out = tuple(refs)
        return out

    @staticmethod
    def _dests(operand: str) -> list[str]:
        if operand.startswith("{"):
            return [t.strip() for t in operand.strip("{} ").split(",") if t.strip().startswith("%")]
        return [operand.split("|")[0]] if operand.startswith("%") else []

    # -- pre-pass: build flows ------------------------------------------------
    def _prepare(self) -> None:
        pending: dict[str, list[tuple[int, str]]] = {}
        ret_owner: dict[str, int] = {}
        flows = self._flows
        for idx, ins in enumerate(self.fn.body):
            if not isinstance(ins, Instruction):
                if getattr(ins, "kind", None) == ".param":
                    pending[ins.text.split()[-1].split("[")[0]] = []
                continue
            base = ins.base
            ops = ins.operands
            if base == "ld" or base == "ldu" or base == "atom":
                self._prepare_load(ins, idx, ret_owner, flows)
                continue
            if base == "st":
                self._prepare_store(ins, pending)
                continue
            if base == "call":
                self._prepare_call(ins, pending, ret_owner)
                continue
            if base in _KILL or not ops:
                continue
            dests = self._dests(ops[0])
            if not dests:
                continue
            if base == "mad" or base == "madc":
                if "hi" in ins.modifiers:
                    continue
                srcs = self._sources(ops[3:4])
            elif base in _FIRST_ONLY:
                srcs = self._sources(ops[1:2])
            elif base in _TWO_OF_THREE:
                srcs = self._sources(ops[1:3])
            else:
                srcs = self._sources(ops[1:])
            if srcs:
                for d in dests:
                    flows.append(("copy", d, srcs))

    def _prepare_load(self, ins: Instruction, idx: int, ret_owner: dict, flows: list) -> None:
        ops = ins.operands
        if len(ops) < 2:
            return
        dests = self._dests(ops[0])
        vt = value_type(ins)
        try:
            wide = vt is not None and type_bytes(vt) >= 8
        except ValueError:
            wide = True
        if not dests or not wide:
            return
        if ins.base == "atom":
            for d in dests:
                flows.append(("const", d, frozenset((MEM,))))
            return
        try:
            name, off = split_address(ops[1])
        except ValueError:
            return
        if "param" in ins.modifiers and name is not None and not name.startswith("%"):
            if name in self._params:
                origin = frozenset((("P", name, off),))
                for d in dests:
                    flows.append(("const", d, origin))
            elif name in ret_owner:
                for d in dests:
                    flows.append(("ret", d, ret_owner[name], name))
            return
        addr = self._sources((f"{name}",)) if name else ()
        for d in dests:
            flows.append(("load", d, addr))

    def _prepare_store(self, ins: Instruction, pending: dict) -> None:
        ops = ins.operands
        if len(ops) < 2:
            return
        try:
            name, off = split_address(ops[0])
        except ValueError:
            return
        if "param" in ins.modifiers:
            if name in pending:
                pending[name].append((off, ops[1]))
            elif name is not None and any(name == r.name for r in self.fn.returns):
                self._ret_stores.append((name, ops[1]))
            return
        self._flows.append(("store", None, self._sources((name,)) if name else (), self._sources(ops[1:])))

    def _prepare_call(self, ins: Instruction, pending: dict, ret_owner: dict) -> None:
        ops = [o for o in ins.operands]
        rets: list[str] = []
        if ops and ops[0].startswith("("):
            rets = [r.strip() for r in ops.pop(0).strip("() ").split(",") if r.strip()]
        callee = ops.pop(0) if ops else None
        arg_names: list[str] = []
        if ops and ops[0].startswith("("):
            arg_names = [a.strip() for a in ops.pop(0).strip("() ").split(",") if a.strip()]
        if callee is not None and callee.startswith("%"):
            callee = None
        args = [self._sources([src for _, src in pending.get(a, [])]) for a in arg_names]
        call = _Call(ins.line, callee, args, rets)
        self.calls.append(call)
        for r in rets:
            ret_owner[r] = len(self.calls) - 1

    # -- fixpoint -----------------------------------------------------------------
    def _value(self, refs: tuple) -> frozenset:
        out = EMPTY
        regs = self.regs
        for ref in refs:
            v = ref if isinstance(ref, frozenset) else regs.get(ref, EMPTY)
            if v:
                out = out | v
        return out

    def _loaded(self, addr: frozenset) -> frozenset:
        out = EMPTY
        plain = False
        for o in addr:
            if o is LOCAL or o == LOCAL:
                out = out | self.cells["local"]
            elif o[0] == "S" and o[2] in ("shared", "local"):
                out = out | self.cells["shared" if o[2] == "shared" else "local"]
            elif o[0] == "A":
                out = out | {("P", o[1], -1)}
            else:
                plain = True
        if plain or not addr:
            out = out | {MEM}
        return out

    def _arg_values(self, call: _Call) -> list[frozenset]:
        return [self._value(refs) for refs in call.args]

    def _ret_value(self, call: _Call, name: str) -> frozenset:
        summary = self.summaries.get(call.callee) if call.callee else None
        if summary is None:
            return frozenset((UNKNOWN,))
        pos = call.rets.index(name)
        if pos >= len(summary.returns_order):
            return frozenset((UNKNOWN,))
        raw = summary.returns.get(summary.returns_order[pos], EMPTY)
        return substitute(raw, summary.params, self._arg_values(call))

    def _solve(self) -> None:
        regs = self.regs
        changed = True
        rounds = 0
        while changed:
            changed = False
            rounds += 1
            for flow in self._flows:
                kind = flow[0]
                if kind == "copy":
                    new = self._value(flow[2])
                elif kind == "const":
                    new = flow[2]
                elif kind == "load":
                    new = self._loaded(self._value(flow[2]))
                elif kind == "ret":
                    new = self._ret_value(self.calls[flow[2]], flow[3])
                else:  # store into a local/shared cell
                    addr = self._value(flow[2])
                    val = self._value(flow[3])
                    if not val:
                        continue
                    for o in addr:
                        cell = "local" if o == LOCAL or (o[0] == "S" and o[2] == "local") else \
                            "shared" if o[0] == "S" and o[2] == "shared" else None
                        if cell and not val <= self.cells[cell]:
                            self.cells[cell] = self.cells[cell] | val
                            changed = True
                    continue
                if not new:
                    continue
                dest = flow[1]
                old = regs.get(dest)
                if old is None:
                    regs[dest] = new
                    changed = True
                elif not new <= old:
                    regs[dest] = old | new
                    changed = True
            if rounds > 10000:  # pragma: no cover - monotone lattice, cannot happen
                raise RuntimeError("provenance fixpoint did not converge")

    # -- results --------------------------------------------------------------
    def _collect_sites(self) -> None:
        for idx, ins in enumerate(self.fn.body):
            if not isinstance(ins, Instruction):
                continue
            ops = ins.operands
            # every memory instruction has an address among its first two operands
            if not ops or ("[" not in ops[0] and (len(ops) < 2 or "[" not in ops[1])):
                continue
            for acc in accesses(ins):
                if acc.operand >= len(ins.operands):
                    continue
                try:
                    name, _ = split_address(ins.operands[acc.operand])
                except ValueError:
                    bases = frozenset((UNKNOWN,))
                else:
                    bases = self._value(self._sources((name,))) if name else EMPTY
                self.sites.append(Site(idx, ins, acc, bases))
        for call in self.calls:
            call.values = self._arg_values(call)

    def summary(self) -> Summary:
        """This function's effects and return values, for its callers."""
        s = Summary([p.name for p in self.fn.params], [r.name for r in self.fn.returns])
        for site in self.sites:
            s.effects.append((site.access.kind, site.access.space, site.bases, site.ins.line))
        s.effects.extend(self.call_effects())
        for name, src in self._ret_stores:
            s.returns[name] = s.returns.get(name, EMPTY) | self._value(self._sources((src,)))
        return s

    def call_effects(self) -> list[tuple[str, str, frozenset, int]]:
        """Accesses made inside callees, rewritten into this function's origins."""
        out = []
        for call in self.calls:
            if call.callee in _HARMLESS_EXTERNS:
                continue
            summary = self.summaries.get(call.callee) if call.callee else None
            if summary is None:
                for value in call.values:
                    if value:
                        out.append(("readwrite", "generic", value, call.line))
                out.append(("unknown", "global", frozenset((UNKNOWN,)), call.line))
                continue
            for kind, space, bases, _line in summary.effects:
                out.append((kind, space, substitute(bases, summary.params, call.values), call.line))
        return out


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
