"""Address provenance: which parameters (or other origins) each register may hold.

A flow-insensitive fixpoint over one function body: every register's value is
the union of what all of its assignments may produce, iterated until nothing
changes. That is sound across branches and loops (it covers every path) and,
because nvcc and LLVM emit PTX in near-SSA form, it loses little precision.

Origins are described in :mod:`ptx.origins`.

Products (mul, shl, ...) drop origins: a scaled pointer is an index, never a
base. If an address ends up with no base at all, the caller treats it as
unknown, which keeps the analysis conservative.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ptx.memops import accesses, split_address, value_type, vector_width
from ptx.model import Function, Instruction, Module, type_bytes
from ptx.origins import EMPTY, LOCAL, MEM, UNKNOWN, Site, Summary, substitute


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
        # what was stored to non-global memory: ("shared"|"local", span) -> origins;
        # span is (offset, width) for a plain store at a fixed stack offset
        # (``[%SP+8]``), else None (anywhere in that space)
        self.cells: dict[tuple, frozenset] = {}
        self.calls: list[_Call] = []
        self.sites: list[Site] = []
        self._flows: list[tuple] = []
        self._ret_stores: list[tuple[str, str]] = []
        self._params = {p.name: p for p in fn.params}
        self._memo: dict[str, tuple] = {}
        self._wide_memo: dict[str, bool] = {}
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
            if tok[0] == "%" or tok in self.fn.registers:
                refs.append(tok)
            else:
                origin = self._const_origin(tok)
                if origin is not None:
                    refs.append(frozenset((origin,)))
        self._memo[operand] = out = tuple(refs)
        return out

    def _wide(self, reg: str) -> bool:
        """Can ``reg`` hold an address? 32/64-bit integer registers are tracked
        (shared-memory addresses are 32-bit; Triton stages pointers through
        shared memory). A pointer squeezed through a float, predicate or
        16-bit register loses its origin, which makes its later use an
        unknown address (indirect), so skipping those never hides a write."""
        hit = self._wide_memo.get(reg)
        if hit is None:
            decl = self.fn.registers.get(reg.rstrip("0123456789")) or self.fn.registers.get(reg)
            hit = decl is None or decl in ("b64", "u64", "s64", "b32", "u32", "s32")
            self._wide_memo[reg] = hit
        return hit

    def _dests(self, operand: str) -> list[str]:
        regs = self.fn.registers
        if operand.startswith("{"):
            names = [t.strip() for t in operand.strip("{} ").split(",")]
            return [t for t in names if t.startswith("%") or t in regs]
        name = operand.split("|")[0]
        return [name] if name.startswith("%") or name in regs else []

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
            dests = [d for d in self._dests(ops[0]) if self._wide(d)]
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
        span = self._stack_span(name, off, ins)
        for d in dests:
            flows.append(("load", d, addr, span))

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
        span = self._stack_span(name, off, ins) if not ops[1].startswith("{") else None
        self._flows.append(("store", None, self._sources((name,)) if name else (), self._sources(ops[1:]), span))

    def _stack_span(self, name: str | None, off: int, ins: Instruction) -> tuple[int, int] | None:
        """(offset, width) when the address is the stack base plus a constant
        (how debug builds spill), so distinct spill slots stay distinct."""
        if name not in ("%SP", "%SPL") or vector_width(ins) != 1:
            return None
        vt = value_type(ins)
        try:
            return (off, type_bytes(vt)) if vt else None
        except ValueError:
            return None

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

    def _cell_values(self, space: str, span: tuple[int, int] | None) -> frozenset:
        out = EMPTY
        for (sp, key), val in self.cells.items():
            if sp != space:
                continue
            if key is None or span is None or (key[0] < span[0] + span[1] and span[0] < key[0] + key[1]):
                out = out | val
        return out

    def _loaded(self, addr: frozenset, span: tuple[int, int] | None = None) -> frozenset:
        out = EMPTY
        plain = False
        for o in addr:
            if o is LOCAL or o == LOCAL:
                out = out | self._cell_values("local", span)
            elif o[0] == "S" and o[2] in ("shared", "local"):
                out = out | self._cell_values(o[2], None)
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
                    new = self._loaded(self._value(flow[2]), flow[3])
                elif kind == "ret":
                    new = self._ret_value(self.calls[flow[2]], flow[3])
                else:  # store into a local/shared cell
                    addr = self._value(flow[2])
                    val = self._value(flow[3])
                    if not val:
                        continue
                    for o in addr:
                        if o == LOCAL:
                            cell = ("local", flow[4])
                        elif o[0] == "S" and o[2] in ("local", "shared"):
                            cell = (o[2], None)
                        else:
                            continue
                        old = self.cells.get(cell, EMPTY)
                        if not val <= old:
                            self.cells[cell] = old | val
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
