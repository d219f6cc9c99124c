"""Static read/write classification of every kernel parameter.

:func:`analyze` (text) and :func:`analyze_module` (parsed) return one
:class:`KernelAccess` per ``.entry``. For each parameter: ``read``,
``write``, ``readwrite`` or ``none``; struct (byte-array) parameters also
report per-field results keyed by byte offset. The cardinal rule is that no
write is ever missed: an address that cannot be traced to a parameter (a
pointer loaded from memory, an opaque call, a TMA tensor map, a module
variable) makes the kernel ``indirect``, and then every parameter that can
hold a pointer is reported ``readwrite``.

Device functions are summarised bottom-up and their effects substituted at
each call; recursive or body-less callees are treated conservatively.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ptx.dataflow import Provenance
from ptx.origins import MEM, UNKNOWN, Site, Summary
from ptx.model import Function, Module
from ptx.parser import no_gc, parse

NONE, READ, WRITE, READWRITE = "none", "read", "write", "readwrite"
_LOCAL_SPACES = ("shared", "local", "const", "param")


def join(a: str, b: str) -> str:
    """Least upper bound of two access kinds (``read`` + ``write`` = ``readwrite``)."""
    if a == b or b == NONE:
        return a
    if a == NONE:
        return b
    return READWRITE


@dataclass(slots=True)
class ParamAccess:
    """Access of one parameter; ``fields`` maps struct byte offsets to access.

    ``pointer`` is true when the parameter is declared ``.ptr`` (Triton) or is
    used as an address; nvcc does not mark pointers, so an unused pointer
    parameter of nvcc PTX reads as ``pointer=False, access="none"``. In an
    indirect kernel every parameter wide enough for an address is a pointer.
    """

    index: int
    name: str
    type: str
    pointer: bool
    access: str
    fields: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The ``--json`` form: index, name, pointer, access (+ fields if any)."""
        out = {"index": self.index, "name": self.name, "pointer": self.pointer, "access": self.access}
        if self.fields:
            out["fields"] = {str(k): v for k, v in sorted(self.fields.items())}
        return out


@dataclass(slots=True)
class KernelAccess:
    """Static result for one kernel.

    ``indirect``: some access could not be bounded by a parameter; the
    kernel must stay with its neighbours. ``reasons`` says why, with lines.
    ``sites``: the kernel's own memory accesses with address provenance
    (used by the instrumenter).
    """

    name: str
    params: list[ParamAccess]
    indirect: bool
    reasons: list[str]
    sites: list[Site]


def analyze(text: str) -> dict[str, KernelAccess]:
    """Parse ``text`` and classify every kernel; see the module docstring."""
    with no_gc():
        return analyze_module(parse(text))


def analyze_module(module: Module) -> dict[str, KernelAccess]:
    """Classify every kernel of a parsed module, in file order."""
    with no_gc():
        summaries = _summaries(module)
        provs = {fn.name: Provenance(fn, module, summaries) for fn in module.entries}
        written = _written_symbols(provs.values(), summaries.values())
        return {fn.name: _classify(fn, provs[fn.name], written) for fn in module.entries}


def _written_symbols(provs, summaries) -> set[str]:
    """Module ``.global`` variables that some function of the module may write.

    Reading a variable nobody writes (e.g. the ``__cudart_i2opi_f`` table that
    ``sin`` uses) creates no dependency between kernels, so it is harmless.
    """
    out = set()
    effects = [e for p in provs for e in ((s.access.kind, s.bases) for s in p.sites)]
    effects += [(k, b) for s in summaries for k, _sp, b, _l in s.effects]
    for kind, bases in effects:
        if kind != "read":
            out.update(o[1] for o in bases if o[0] == "S" and o[2] == "global")
    return out


def _summaries(module: Module) -> dict[str, Summary]:
    """Bottom-up summaries of every ``.func`` with a body; cycles stay absent."""
    done: dict[str, Summary] = {}
    active: set[str] = set()
    bodies = {f.name: f for f in module.functions.values()
              if not f.is_entry and f.body_start is not None}

    def visit(name: str) -> None:
        if name in done or name in active or name not in bodies:
            return
        active.add(name)
        fn = bodies[name]
        stack = [(fn, iter(sorted(fn.callees())))]
        # iterative DFS keeps deep call chains off the Python stack
        while stack:
            cur, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                active.discard(cur.name)
                done[cur.name] = Provenance(cur, module, done).summary()
                continue
            if nxt in bodies and nxt not in done and nxt not in active:
                active.add(nxt)
                stack.append((bodies[nxt], iter(sorted(bodies[nxt].callees()))))

    for name in bodies:
        visit(name)
    return done


def _classify(fn: Function, prov: Provenance, written: set[str]) -> KernelAccess:
    effects = [(s.access.kind, s.access.space, s.bases, s.ins.line) for s in prov.sites]
    effects.extend(prov.call_effects())
    params = {p.name: p for p in fn.params}
    plain: dict[str, str] = {}
    fields: dict[str, dict[int, str]] = {}
    reasons: list[str] = []

    for kind, space, bases, line in effects:
        if space in _LOCAL_SPACES:
            continue
        if kind == "unknown":
            reasons.append(f"line {line}: opaque access (tensor map, texture, surface or unknown call)")
            continue
        acc = READWRITE if kind in ("readwrite", "unknown") else kind
        for o in bases:
            tag = o[0]
            if tag == "P" and o[1] in params:
                p = params[o[1]]
                if p.is_aggregate:
                    per = fields.setdefault(p.name, {})
                    per[o[2]] = join(per.get(o[2], NONE), acc)
                else:
                    plain[p.name] = join(plain.get(p.name, NONE), acc)
            elif o is MEM or o == MEM:
                reasons.append(f"line {line}: address loaded from memory")
            elif o == UNKNOWN:
                reasons.append(f"line {line}: address from an opaque operation")
            elif tag == "S" and o[2] == "global" and (acc != READ or o[1] in written):
                reasons.append(f"line {line}: access to module variable {o[1]!r}")
        if not bases:
            reasons.append(f"line {line}: address not derived from any parameter")

    indirect = bool(reasons)
    out = []
    for p in fn.params:
        per = fields.get(p.name, {})
        access = plain.get(p.name, NONE)
        for a in per.values():
            access = join(access, a)
        if -1 in per:  # a field at an unknown offset taints the whole struct
            access = join(access, per.pop(-1))
            per = {k: join(v, access) for k, v in per.items()}
        if indirect and p.may_hold_pointer:
            access = READWRITE
            per = {k: READWRITE for k in per}
        pointer = p.is_ptr or access != NONE
        out.append(ParamAccess(p.index, p.name, p.type, pointer, access, per))
    return KernelAccess(fn.name, out, indirect, sorted(set(reasons), key=_line_key), prov.sites)


def _line_key(reason: str) -> int:
    try:
        return int(reason.split(":", 1)[0].split()[1])
    except (IndexError, ValueError):
        return 0
