"""Static cost features of a kernel, the cost model's input.

Counts are static (instructions in the text, not executed), which is what a
cost model that is calibrated per device needs as a fingerprint. Device
functions reachable through ``call`` are counted once into the kernel.
"""
from __future__ import annotations

import re

from ptx.memops import accesses, value_type
from ptx.model import Function, Instruction, Module

_ARITH = {"add", "sub", "mul", "mad", "fma", "div", "rem", "min", "max", "neg", "abs", "sqrt",
          "rsqrt", "rcp", "ex2", "lg2", "sin", "cos", "tanh", "setp", "selp", "and", "or", "xor",
          "not", "shl", "shr", "shf", "popc", "clz", "bfe", "bfi", "lop3", "prmt", "cvt", "copysign",
          "testp", "addc", "subc", "madc", "mul24", "mad24", "sad", "dp4a", "dp2a", "brev", "bfind"}
_BARRIER = {"bar", "barrier"}
_DIMS = re.compile(r"\.(reqntid|maxntid|maxnreg|minnctapersm)\s+([\d,\s]+)")


def _type_class(t: str | None) -> str:
    if t is None:
        return "int"
    if t.startswith("bf16"):
        return "bf16"
    if t.startswith("f16"):
        return "fp16"
    if t == "f32" or t == "tf32":
        return "fp32"
    if t == "f64":
        return "fp64"
    if t.startswith("e4m3") or t.startswith("e5m2"):
        return "fp8"
    return "int"


def _reachable(fn: Function, module: Module) -> list[Function]:
    seen = {fn.name}
    order = [fn]
    i = 0
    while i < len(order):
        for s in order[i].body:
            if isinstance(s, Instruction) and s.base == "call":
                for op in s.operands:
                    if not op.startswith(("(", "%")):
                        callee = module.functions.get(op)
                        if callee is not None and callee.name not in seen and callee.body_start is not None:
                            seen.add(callee.name)
                            order.append(callee)
                        break
        i += 1
    return order


def kernel_features(fn: Function, module: Module) -> dict:
    """Feature dict of one kernel (see the keys below; all plain ints/dicts)."""
    mix = {"fp32": 0, "fp64": 0, "fp16": 0, "bf16": 0, "fp8": 0, "int": 0}
    f = {
        "instructions": 0, "mma": 0, "wgmma": 0, "arith": mix,
        "global_load_bytes": {}, "global_store_bytes": {}, "global_load_total": 0,
        "global_store_total": 0, "shared_load": 0, "shared_store": 0, "atomics": 0,
        "barriers": 0, "mbarriers": 0, "branches": 0, "calls": 0, "cp_async": 0,
        "shared_static_bytes": 0, "shared_dynamic": False, "local_bytes": 0,
        "launch_bounds": {},
    }
    for m in _DIMS.finditer(fn.header_text):
        f["launch_bounds"][m.group(1)] = [int(x) for x in m.group(2).replace(",", " ").split()]
    funcs = _reachable(fn, module)
    for g in funcs:
        for sym in g.symbols.values():
            if sym.space == "shared":
                f["shared_static_bytes"] += sym.size
                f["shared_dynamic"] |= sym.extern
            elif sym.space == "local":
                f["local_bytes"] += sym.size
        for s in g.body:
            if isinstance(s, Instruction):
                _count(s, f)
    for sym in module.symbols.values():
        if sym.space == "shared":
            if sym.extern or sym.size == 0:
                f["shared_dynamic"] = True
            else:
                f["shared_static_bytes"] += sym.size
    return f


def _count(ins: Instruction, f: dict) -> None:
    f["instructions"] += 1
    base = ins.base
    op = ins.opcode
    if base == "wgmma" and "mma_async" in op:
        f["wgmma"] += 1
        f["mma"] += 1
        return
    if base == "mma" or (base in ("wmma", "tcgen05") and ".mma" in op):
        f["mma"] += 1
        return
    if base in _BARRIER:
        f["barriers"] += 1
        return
    if base == "mbarrier":
        f["mbarriers"] += 1
        return
    if base == "bra":
        f["branches"] += 1
        return
    if base == "call":
        f["calls"] += 1
        return
    if base in ("atom", "red"):
        f["atomics"] += 1
    if op.startswith("cp.async") and "group" not in op:
        f["cp_async"] += 1
    if base in _ARITH:
        f["arith"][_type_class(value_type(ins))] += 1
        return
    if not any("[" in o for o in ins.operands):
        return
    for acc in accesses(ins):
        width = acc.width or 0
        if acc.space in ("global", "generic"):
            if acc.kind in ("read", "readwrite"):
                _bump(f["global_load_bytes"], width)
                f["global_load_total"] += width
            if acc.kind in ("write", "readwrite"):
                _bump(f["global_store_bytes"], width)
                f["global_store_total"] += width
        elif acc.space == "shared":
            f["shared_load" if acc.kind == "read" else "shared_store"] += 1


def _bump(d: dict, width: int) -> None:
    key = str(width)
    d[key] = d.get(key, 0) + 1



__all__ = ["kernel_features"]
