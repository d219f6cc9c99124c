"""Rewrite PTX so that one run records the address range of every access site.

:func:`instrument` returns an :class:`Instrumented`: the new PTX text and the
site table. Contract of the rewritten module:

* every ``.entry`` gets one extra trailing parameter ``<kernel>_tessera_probe``
  (``.u64``): the device address of a slot buffer of ``16 * len(sites)``
  bytes; slot ``i`` is at ``base + 16*i`` and holds ``min`` (u64 at +0) and
  ``max`` (u64 at +8) of the effective addresses seen by site ``i``. The host
  must initialise min to ``2**64-1`` and max to 0 (see :func:`initial_slots`);
  an untouched slot keeps ``min > max``.
* before every global (or possibly global, i.e. generic) access site an
  ``atom.global.min.u64``/``atom.global.max.u64`` pair on the effective
  address is inserted, under the site's own predicate guard so masked-off
  lanes record nothing.
* sites inside ``.func`` device functions read the slot base from a module
  variable ``__tessera_probe`` that each entry sets at start; therefore at
  most one instrumented kernel of a module may run at a time.

Sites whose address is not a 64-bit register or symbol (e.g. TMA tensor-map
operands) are listed with ``instrumented=False``.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ptx.analysis import analyze_module
from ptx.dataflow import Provenance
from ptx.errors import PtxInstrumentError
from ptx.memops import split_address
from ptx.model import Function, Instruction, Module
from ptx.parser import parse

PROBE_SUFFIX = "_tessera_probe"
PROBE_GLOBAL = "__tessera_probe"
SLOT_BYTES = 16
_REG_PREFIX = re.compile(r"^(%[A-Za-z_$]+?)\d*$")


@dataclass(frozen=True, slots=True)
class SiteInfo:
    """One instrumented access site.

    ``params``: names of the kernel parameters its address derives from
    (statically); empty for device-function sites or indirect addresses.
    ``kind``: ``read``/``write``/``readwrite``; ``width``: bytes per access
    (``None`` if not static; range recovery then assumes 1).
    """

    index: int
    function: str
    line: int
    opcode: str
    kind: str
    width: int | None
    params: tuple[str, ...]
    instrumented: bool = True

    def to_json(self) -> dict:
        """Plain-dict form for JSON output."""
        d = asdict(self)
        d["params"] = list(self.params)
        return d


@dataclass(slots=True)
class Instrumented:
    """Result of :func:`instrument`: new text, site table, per-kernel sites."""

    text: str
    sites: list[SiteInfo]
    kernels: dict[str, list[int]]

    @property
    def slot_bytes(self) -> int:
        """Size of the slot buffer every instrumented launch needs."""
        return SLOT_BYTES * max(1, len(self.sites))


def initial_slots(n_sites: int) -> bytes:
    """Host bytes for a fresh slot buffer: min = 2**64-1, max = 0 per slot."""
    return (b"\xff" * 8 + b"\x00" * 8) * max(1, n_sites)


def _is_wide_register(fn: Function, name: str) -> bool:
    t = fn.registers.get(name)
    if t is None:
        m = _REG_PREFIX.match(name)
        t = fn.registers.get(m.group(1)) if m else None
    return t is not None and t.endswith("64")


def _global_site(bases: frozenset, space: str) -> bool:
    if space == "global":
        return True
    if space != "generic":
        return False
    # generic accesses that provably stay in shared/local memory are not global
    return not bases or any(
        o[0] in ("P", "M", "U") or (o[0] == "S" and o[2] == "global") for o in bases)


def instrument(text: str) -> Instrumented:
    """Instrument every kernel of ``text``; see the module docstring."""
    module = parse(text)
    return instrument_module(module, text)


def instrument_module(module: Module, text: str) -> Instrumented:
    """Instrument a parsed module; ``text`` must be the text it was parsed from."""
    if not module.entries:
        raise PtxInstrumentError("module has no .entry kernel to instrument")
    results = analyze_module(module)
    lines = text.replace("\r\n", "\n").split("\n")
    before: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    sites: list[SiteInfo] = []
    per_function: dict[str, list[int]] = {}
    summaries: dict = {}
    for fn in module.functions.values():
        if fn.body_start is None:
            continue
        fn_sites = results[fn.name].sites if fn.is_entry else Provenance(fn, module, summaries).sites
        per_function[fn.name] = _rewrite_sites(fn, fn_sites, sites, before)
    uses_global = any(per_function[f.name] for f in module.functions.values()
                      if not f.is_entry and f.name in per_function)
    for fn in module.functions.values():
        if fn.body_start is None:
            continue
        if fn.is_entry:
            _add_probe_param(fn, lines)
        after.setdefault(fn.body_start, []).extend(_prologue(fn, uses_global))
    out: list[str] = []
    if uses_global:
        first_fn = min(f.line for f in module.functions.values())
        before.setdefault(first_fn, []).insert(0, f".global .align 8 .u64 {PROBE_GLOBAL};")
    for no, line in enumerate(lines, start=1):
        pending = before.get(no, ())
        header = [p for p in pending if isinstance(p, str)]
        probes = [p for p in pending if not isinstance(p, str)]
        out.extend(header)
        out.extend(_weave(line, probes) if probes else (line,))
        out.extend(after.get(no, ()))
    kernels = {}
    calls = _reachable(module)
    for fn in module.entries:
        idx = list(per_function.get(fn.name, []))
        for callee in sorted(calls.get(fn.name, ())):
            idx.extend(per_function.get(callee, []))
        kernels[fn.name] = sorted(idx)
    return Instrumented("\n".join(out), sites, kernels)


def _rewrite_sites(fn: Function, fn_sites, sites: list[SiteInfo], before: dict) -> list[int]:
    mine = []
    for site in fn_sites:
        acc = site.access
        if not _global_site(site.bases, acc.space) or acc.kind == "unknown":
            if acc.kind == "unknown":
                sites.append(SiteInfo(len(sites), fn.name, site.ins.line, site.ins.opcode,
                                      "readwrite", None, (), instrumented=False))
                mine.append(len(sites) - 1)
            continue
        ins: Instruction = site.ins
        try:
            name, off = split_address(ins.operands[acc.operand])
        except ValueError:
            name = None
        params = tuple(sorted({o[1] for o in site.bases if o[0] == "P"})) if fn.is_entry else ()
        index = len(sites)
        is_reg = name is not None and (name.startswith("%") or name in fn.registers)
        ok = name is not None and (not is_reg or _is_wide_register(fn, name))
        sites.append(SiteInfo(index, fn.name, ins.line, ins.opcode, acc.kind, acc.width, params, ok))
        mine.append(index)
        if not ok:
            continue
        guard = f"@{ins.guard} " if ins.guard else ""
        code = []
        if is_reg:
            code.append(f"\t{guard}add.s64 %tsa1, {name}, {off};")
        else:
            code.append(f"\t{guard}mov.u64 %tsa1, {name};")
            code.append(f"\t{guard}add.s64 %tsa1, %tsa1, {off};")
        slot = SLOT_BYTES * index
        code.append(f"\t{guard}atom.global.min.u64 %tsa2, [%tsa0+{slot}], %tsa1;")
        code.append(f"\t{guard}atom.global.max.u64 %tsa2, [%tsa0+{slot + 8}], %tsa1;")
        before.setdefault(ins.line, []).append((ins, code))
    return mine


_GUARD_TAIL = re.compile(r"@!?%?[\w$]+\s*$")


def _weave(line: str, probes: list) -> list[str]:
    """Split ``line`` so each probe lands right before its own statement.

    Usually a site is alone on its line and the probes simply precede it;
    inline-asm blocks may pack several statements (and a label) on one line,
    where inserting before the whole line could read an address register
    before the block computes it.
    """
    out: list[str] = []
    cursor = 0
    for ins, code in probes:
        prefix = rf"@{re.escape(ins.guard)}\s+" if ins.guard else ""
        pattern = re.compile(prefix + r"(?<![\w.$%])" + re.escape(ins.opcode) + r"(?=[\s;])")
        pos, match = cursor, None
        while True:
            match = pattern.search(line, pos)
            if match is None or ins.guard or not _GUARD_TAIL.search(line, 0, match.start()):
                break
            pos = match.end()
        if match is None:
            out.extend(code)  # cannot locate it: before the whole line is the best guess
            continue
        head = line[cursor:match.start()]
        if head.strip():
            out.append(head)
        out.extend(code)
        cursor = match.start()
    out.append(line[cursor:])
    return out


def _prologue(fn: Function, uses_global: bool) -> list[str]:
    code = ["\t.reg .b64 %tsa<3>;"]
    if fn.is_entry:
        code.append(f"\tld.param.u64 %tsa0, [{fn.name}{PROBE_SUFFIX}];")
        code.append("\tcvta.to.global.u64 %tsa0, %tsa0;")
        if uses_global:
            code.append(f"\tst.global.u64 [{PROBE_GLOBAL}], %tsa0;")
    elif uses_global:
        code.append(f"\tld.global.u64 %tsa0, [{PROBE_GLOBAL}];")
    return code


def _add_probe_param(fn: Function, lines: list[str]) -> None:
    """Append the probe parameter to the entry's parameter list, in place."""
    start = fn.line - 1
    end = (fn.body_start or fn.line) - 1
    for no in range(start, end + 1):
        line = lines[no]
        col = line.find(fn.name + "(") if no == start else 0
        pos = line.find(")", max(col, 0)) if (no > start or col >= 0) else -1
        if pos >= 0:
            empty = not fn.params
            sep = "" if empty else ",\n\t"
            lines[no] = line[:pos] + f"{sep}.param .u64 {fn.name}{PROBE_SUFFIX}" + line[pos:]
            return
    raise PtxInstrumentError(f"line {fn.line}: cannot find the parameter list of {fn.name!r}")


def _reachable(module: Module) -> dict[str, set[str]]:
    direct: dict[str, set[str]] = {}
    for fn in module.functions.values():
        direct[fn.name] = fn.callees()
    out = {}
    for fn in module.entries:
        seen: set[str] = set()
        todo = list(direct.get(fn.name, ()))
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(direct.get(n, ()))
        out[fn.name] = seen
    return out
